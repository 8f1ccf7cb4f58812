"""Backend discovery and per-config support, with imports and the library mocked (CPU only).

Every "no" must come with a reason: these tests pin the reasons' content, not just their presence.
"""

import sys
import types

import pytest
import torch
from flash_hopper.bench import backends, peers
from flash_hopper.bench.cases import Case
from flash_hopper.bench.flops import visible_pairs_exact

H100 = (9, 0)
A100 = (8, 0)


def case(**overrides):
    fields = {"batch": 2, "seqlen_q": 512, "seqlen_k": 512, "heads": 16, "heads_kv": 16,
              "head_dim": 128}
    fields.update(overrides)
    return Case(**fields)


def fake_flash_attn(name="flash_attn", with_softcap=True):
    module = types.ModuleType(name)
    if with_softcap:
        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0):
            return q
    else:
        def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
            return q
    module.flash_attn_func = flash_attn_func
    module.__version__ = "9.9.9"
    return module


def test_external_backend_found_when_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    backend = backends.registry(include_variants=False)["flash-attn"]
    assert backend.probe(H100) is None
    assert backend.probe(None) == "no CUDA GPU visible"
    assert backend.probe((7, 5)).startswith("needs compute capability >= 8.0")
    assert backend.unsupported(case(softcap=30.0)) is None
    q = torch.zeros(1, 4, 2, 8)
    assert backend.make_forward(q, q, q, case())() is q
    assert backend.kernel(q, q, q, case()) == ("flash-attn", "flash_attn.flash_attn_func")


def test_external_backend_missing_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    backend = backends.registry(include_variants=False)["flash-attn"]
    reason = backend.probe(H100)
    assert reason.startswith("not importable")
    assert "flash_attn" in reason


def test_external_backend_without_softcap_argument(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(with_softcap=False))
    backend = backends.registry(include_variants=False)["flash-attn"]
    assert backend.probe(H100) is None
    assert "softcap" in backend.unsupported(case(softcap=30.0))
    assert "window_size" in backend.unsupported(case(window=(128, 0)))


def test_fa3_package_tries_each_module_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    package = types.ModuleType("flash_attn_3")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn_3", package)
    monkeypatch.setitem(sys.modules, "flash_attn_3.flash_attn_interface",
                        fake_flash_attn("flash_attn_3.flash_attn_interface"))
    backend = backends.resolve(["flash_attn_interface"],
                               backends.registry(include_variants=False))[0]
    assert backend.name == "flash-attn3"
    assert backend.probe(H100) is None
    assert backend.probe(A100) == "needs an sm9x GPU; this one is sm80"
    q = torch.zeros(1, 4, 2, 8)
    # FA3's beta interface returns (out, lse): the backend hands back out only.
    backend._func = lambda q, k, v, **kw: (q, None)
    assert backend.make_forward(q, q, q, case())() is q


def test_cute_backend_needs_the_submodule(monkeypatch):
    parent = types.ModuleType("flash_attn")
    parent.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    backend = backends.registry(include_variants=False)["flash-attn-cute"]
    assert "flash_attn.cute" in backend.probe(H100)


def fake_library(monkeypatch, info):
    """Make flash_hopper.build_info() return `info` (or raise it, for an exception)."""
    import flash_hopper

    def build_info():
        if isinstance(info, Exception):
            raise info
        return dict(info)

    monkeypatch.setattr(flash_hopper, "build_info", build_info)


SM80_BUILD = {"version": "0.1.0", "commit": "abc", "archs": ["sm80"], "head_dims": [64, 128],
              "dtypes": ["bf16", "fp16"], "cuda": "12.8"}


def test_our_paths_follow_build_info(monkeypatch):
    fake_library(monkeypatch, SM80_BUILD)
    known = backends.registry()
    assert known["fa2"].probe(H100) is None
    assert known["fa2"].probe(A100) is None
    assert known["fa3"].probe(H100) == "library built without sm90 kernels (archs: sm80)"
    fa2 = known["fa2"]
    assert fa2.unsupported(case(head_dim=64)) is None
    assert "bucket 256" in fa2.unsupported(case(head_dim=256))
    assert fa2.unsupported(case(), "bwd") == "backward not available in flash-hopper yet"
    assert fa2.unsupported(case(), "fwd+bwd") == "backward not available in flash-hopper yet"
    assert fa2.version() == "0.1.0 (abc)"


def test_fa3_needs_hopper(monkeypatch):
    fake_library(monkeypatch, dict(SM80_BUILD, archs=["sm80", "sm90a"]))
    fa3 = backends.registry()["fa3"]
    assert fa3.probe(H100) is None
    assert fa3.probe(A100) == "needs an sm9x GPU; this one is sm80"
    assert fa3.probe((10, 0)) == "needs an sm9x GPU; this one is sm100"


def test_library_missing_is_a_reason(monkeypatch):
    fake_library(monkeypatch, OSError("libflash_hopper.so: cannot open shared object file"))
    known = backends.registry()
    for name in ("fa3", "fa2"):
        reason = known[name].probe(H100)
        assert reason.startswith("flash-hopper library not loadable: OSError")


def test_fa3_variants_from_build_info(monkeypatch):
    info = dict(SM80_BUILD, archs=["sm80", "sm90a"], fa3_variants=["fa3-no-pingpong"])
    fake_library(monkeypatch, info)
    known = backends.registry()
    assert "fa3-no-pingpong" in known
    assert known["fa3-no-pingpong"].probe(H100) is None
    assert known["fa3-no-pingpong"].path == "fa3-no-pingpong"
    chosen = backends.resolve(["all"], known)
    assert "fa3-no-pingpong" in [b.name for b in chosen]
    # A variant this build does not have is kept and explains itself instead of crashing.
    missing = backends.resolve(["fa3-no-overlap"], known)[0]
    assert "fa3-no-pingpong" in missing.probe(H100)


def test_resolve_aliases_order_and_errors():
    known = backends.registry(include_variants=False)
    names = [b.name for b in backends.resolve(["sdpa-cudnn", "flash_attn", "fa2", "fa2"], known)]
    assert names == ["sdpa-cudnn", "flash-attn", "fa2"]
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backends.resolve(["nope"], known)
    assert backends.DEFAULT_BACKENDS == ("fa3", "fa2", "sdpa-flash", "sdpa-cudnn")


def test_sdpa_support_rules():
    flash, cudnn, efficient, math = (peers.SdpaBackend(k) for k in peers.SDPA_KINDS)
    assert flash.unsupported(case()) is None
    assert flash.unsupported(case(causal=True)) is None
    assert "top-left" in flash.unsupported(case(causal=True, seqlen_k=1024))
    assert "window" in cudnn.unsupported(case(window=(128, 0)))
    assert efficient.unsupported(case(window=(128, 0))) is None
    assert efficient.unsupported(case(causal=True, seqlen_k=1024)) is None
    assert "GQA" in efficient.unsupported(case(heads_kv=4))
    assert flash.unsupported(case(heads_kv=4)) is None
    assert "softcap" in math.unsupported(case(softcap=30.0))
    assert "small sizes only" in math.unsupported(case(batch=1, seqlen_q=16384,
                                                       seqlen_k=16384))
    assert math.unsupported(case(batch=1, seqlen_q=1024, seqlen_k=1024)) is None


def test_sdpa_probe_without_gpu():
    assert peers.SdpaBackend("flash").probe(None) == "no CUDA GPU visible"


def test_flex_without_triton(monkeypatch):
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    assert "triton" in peers.FlexBackend().probe(H100)


@pytest.mark.parametrize("sq,sk", [(7, 7), (5, 11), (11, 5)])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (3, 0)), (False, (2, 4)),
                                           (True, (4, -1)), (False, (-1, 2))])
def test_masks_match_flop_counting(sq, sk, causal, window):
    mask = peers.visible_mask(sq, sk, causal, window)
    assert int(mask.sum()) == visible_pairs_exact(sq, sk, causal, window)
    mask_mod = peers.make_mask_mod(sq, sk, causal, window)
    rows = torch.arange(sq).view(-1, 1)
    cols = torch.arange(sk).view(1, -1)
    assert torch.equal(mask_mod(0, 0, rows, cols), mask)


def test_sdpa_with_explicit_mask_runs_on_cpu():
    # sdpa-math on CPU with a bottom-right causal mask equals the flash-hopper reference.
    from flash_hopper import reference

    c = case(batch=1, seqlen_q=5, seqlen_k=9, heads=2, heads_kv=2, head_dim=16, causal=True,
             dtype="bf16")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 16, generator=gen, dtype=torch.float32)
    k = torch.randn(1, 9, 2, 16, generator=gen, dtype=torch.float32)
    v = torch.randn(1, 9, 2, 16, generator=gen, dtype=torch.float32)
    backend = peers.SdpaBackend("math")
    assert backend.kernel(q, k, v, c)[1].startswith("explicit boolean mask")
    out = backend.make_forward(q, k, v, c)()
    ref = reference.attention_ref(q, k, v, causal=True)[0]
    assert out.shape == q.shape
    assert torch.allclose(out, ref, atol=1e-5)
