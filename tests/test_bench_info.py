"""`flash-hopper info` logic without a GPU: hypothetical paths from build_info and dispatch."""

import flash_hopper
import pytest
from flash_hopper.bench import env, info

SM80_BUILD = {"version": "0.1.0", "commit": "abc", "archs": ["sm80"], "head_dims": [64, 128],
              "dtypes": ["bf16", "fp16"], "cuda": "12.8"}


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(env, "detect_gpu", lambda index=None: (None, "mocked: no device"))


def with_build(monkeypatch, build):
    def build_info():
        if isinstance(build, Exception):
            raise build
        return dict(build)

    monkeypatch.setattr(flash_hopper, "build_info", build_info)


def test_paths_for_example_gpus_from_build_info(monkeypatch, no_gpu):
    with_build(monkeypatch, SM80_BUILD)
    report = info.gather(head_dim=128, dtype="bf16", backend="auto", causal=False)
    assert report["gpu"] is None
    where = {entry["where"].split(" (")[0]: entry for entry in report["paths"]}
    assert where["a cc 9.0 GPU"]["path"] == "fa2"
    assert "no fa3 kernel" in where["a cc 9.0 GPU"]["reason"]
    assert where["a cc 8.0 GPU"]["path"] == "fa2"
    text = info.render(report)
    assert "no GPU (mocked: no device)" in text
    assert "archs sm80" in text
    assert "head dims 64 128" in text


def test_path_with_fa3_built_and_forced_backend(monkeypatch, no_gpu):
    with_build(monkeypatch, dict(SM80_BUILD, archs=["sm80", "sm90a"]))
    report = info.gather(128, "bf16", "fa3", False, capability=(9, 0))
    (entry,) = report["paths"]
    assert entry["path"] == "fa3"
    report = info.gather(128, "bf16", "fa3", False, capability=(8, 6))
    (entry,) = report["paths"]
    assert "compute capability 9.0" in entry["error"]
    assert "none:" in info.render(report)


def test_unbuilt_head_dim(monkeypatch, no_gpu):
    with_build(monkeypatch, SM80_BUILD)
    report = info.gather(256, "bf16", "auto", False, capability=(8, 0))
    assert "FH_HEAD_DIMS" in report["paths"][0]["error"]


def test_library_missing(monkeypatch, no_gpu):
    with_build(monkeypatch, OSError("libflash_hopper.so not found"))
    report = info.gather(128, "bf16", "auto", False)
    text = info.render(report)
    assert "library : not loadable: OSError: libflash_hopper.so not found" in text
    assert report["paths"][0]["error"].startswith("library not loadable")


def test_built_predicate():
    built = info.built_predicate(dict(SM80_BUILD, archs=["sm80", "sm_90a"]))
    assert built("fa3", "bf16", 128)
    assert built("fa2", "fp16", 64)
    assert not built("fa2", "bf16", 256)
    assert not built("fa2", "fp8", 64)
