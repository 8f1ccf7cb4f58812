"""`flash-hopper info` without a GPU: hypothetical paths from the library's own policy."""

import flash_hopper
import pytest
from flash_hopper import dispatch
from flash_hopper.bench import env, info


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(env, "detect_gpu", lambda index=None: (None, "mocked: no device"))


def _answer(capability, head_dim, dtype="bf16", backend="auto"):
    """What the library's policy says, as info shows it: (path, reason) or ("error", message)."""
    try:
        return dispatch.hypothetical(capability, dtype, head_dim, backend)
    except NotImplementedError as exc:
        return "error", str(exc)


def test_paths_for_example_gpus_come_from_the_library(lib, no_gpu):
    report = info.gather(head_dim=64, dtype="bf16", backend="auto", causal=False)
    assert report["gpu"] is None
    where = {entry["where"].split(" (")[0]: entry for entry in report["paths"]}
    assert set(where) == {"a cc 9.0 GPU", "a cc 8.0 GPU"}
    for capability in ((9, 0), (8, 0)):
        entry = where[f"a cc {capability[0]}.{capability[1]} GPU"]
        path, reason = _answer(capability, 64)
        if path == "error":
            assert entry["error"].endswith(reason)
        else:
            assert (entry["path"], entry["reason"]) == (path, reason)
    text = info.render(report)
    assert "no GPU (mocked: no device)" in text
    assert "(hypothetical: the library's policy)" in text
    build = lib.build_info()
    assert f"archs {' '.join(build['archs'])}" in text
    for kernel in build["kernels"]:  # one line per path and dtype lists the built head dims
        assert f"{kernel['backend']} {kernel['dtype']}: head dims" in text
    decode = build["decode"]  # and the decode kernel's table, in every build
    assert (f"decode {' '.join(decode['dtypes'])}: head dims "
            f"{' '.join(map(str, decode['head_dims']))} (at most {decode['max_rows']}") in text
    # head dim 64 (a decode head dim) on the example GPUs: the decode kernel runs those 128 rows
    assert {entry.get("path") for entry in report["paths"]} == {"decode"}
    if "sm80" in build["archs"]:  # the FA-2 path's PTX runs newer GPUs by JIT: info says so
        assert "PTX compute_80 (the driver JIT-compiles it for newer GPUs" in text
    assert f"link {build['link']}" in text


def test_forced_backend_on_a_given_capability(lib, no_gpu):
    report = info.gather(64, "bf16", "fa3", False, capability=(8, 6))
    (entry,) = report["paths"]
    assert "compute capability 9.0" in entry["error"] and "cc 8.6" in entry["error"]
    assert "none:" in info.render(report)
    report = info.gather(64, "bf16", "fa3", False, capability=(9, 0))
    (entry,) = report["paths"]
    if lib.has_fwd_kernel(flash_hopper._lib.FhBackend.FA3, flash_hopper._lib.FhDtype.BF16, 64):
        assert entry["path"] == "fa3"
        assert entry["reason"] == "fa3 requested; cc 9.0 and fa3 kernel built for bf16 hdim 64"
    else:
        assert "FH_ARCHS including 90a" in entry["error"]


def test_an_unbuilt_head_dim_names_the_build_variable(lib, no_gpu, monkeypatch):
    # the FA paths' answer: the decode kernel serves the report's short queries at d64 / d128
    monkeypatch.setenv("FLASH_HOPPER_DECODE", "0")
    built = set(lib.build_info()["head_dims"])
    missing = [d for d in (64, 96, 128, 192, 256) if d not in built]
    if not missing:
        pytest.skip("this build has every head-dim bucket")
    report = info.gather(missing[0], "bf16", "auto", False, capability=(8, 0))
    assert f"FH_HEAD_DIMS including {missing[0]}" in report["paths"][0]["error"]


def test_library_missing(monkeypatch, no_gpu):
    def build_info():
        raise OSError("libflash_hopper.so not found")

    monkeypatch.setattr(flash_hopper, "build_info", build_info)
    report = info.gather(128, "bf16", "auto", False)
    text = info.render(report)
    assert "library : not loadable: OSError: libflash_hopper.so not found" in text
    assert report["paths"][0]["error"].startswith("library not loadable")
