"""Backend discovery and per-config support, with imports and the library mocked (CPU only).

Every "no" must come with a reason: these tests pin the reasons' content, not just their presence.
"""

import ast
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
from flash_hopper.bench import backends, peers, registry
from flash_hopper.bench.cases import Case
from flash_hopper.mask import AttentionMask

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
    backend = registry.known_backends(include_variants=False)["flash-attn"]
    assert backend.probe(H100) is None
    assert backend.probe(None) == "no CUDA GPU visible"
    assert backend.probe((7, 5)).startswith("needs compute capability >= 8.0")
    assert backend.unsupported(case(softcap=30.0)) is None
    q = torch.zeros(1, 4, 2, 8)
    assert backend.make_forward(q, q, q, case())() is q
    assert backend.kernel(q, q, q, case()) == ("flash-attn", "flash_attn.flash_attn_func")


def test_external_backend_missing_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    backend = registry.known_backends(include_variants=False)["flash-attn"]
    reason = backend.probe(H100)
    assert reason.startswith("not importable")
    assert "flash_attn" in reason


def test_external_backend_without_softcap_argument(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn(with_softcap=False))
    backend = registry.known_backends(include_variants=False)["flash-attn"]
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
    backend = registry.resolve(["flash_attn_interface"],
                               registry.known_backends(include_variants=False))[0]
    assert backend.name == "flash-attn3"
    assert backend.probe(H100) is None
    assert backend.probe(A100) == "needs an sm9x GPU; this one is sm80"
    q = torch.zeros(1, 4, 2, 8)
    # FA3's beta interface returns (out, lse): the backend hands back out only.
    backend._func = lambda q, k, v, **kw: (q, None)
    assert backend.make_forward(q, q, q, case())() is q


def test_fa3_package_takes_the_fa3_fwd_wheel(monkeypatch):
    """The fa3-fwd wheel (FA3's forward built against torch's stable ABI) is FA3's peer when no
    flash_attn_interface / flash_attn_3 is installed, under its own names too."""
    for name in ("flash_attn_interface", "flash_attn_3.flash_attn_interface", "flash_attn_3"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", fake_flash_attn("fa3_fwd_interface"))
    known = registry.known_backends(include_variants=False)
    for spelling in ("flash-attn3", "fa3_fwd_interface", "fa3-fwd"):
        backend = registry.resolve([spelling], known)[0]
        assert backend.name == "flash-attn3"
    assert backend.probe(H100) is None
    assert backend.kernel(None, None, None, case())[1] == "fa3_fwd_interface.flash_attn_func"


def test_cute_backend_needs_the_submodule(monkeypatch):
    parent = types.ModuleType("flash_attn")
    parent.__path__ = []
    monkeypatch.setitem(sys.modules, "flash_attn", parent)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    backend = registry.known_backends(include_variants=False)["flash-attn-cute"]
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
    known = registry.known_backends()
    assert known["fa2"].probe(H100) is None
    assert known["fa2"].probe(A100) is None
    assert known["fa3"].probe(H100) == "library built without sm90 kernels (archs: sm80)"
    fa2 = known["fa2"]
    assert fa2.unsupported(case(head_dim=64)) is None
    assert "bucket 256" in fa2.unsupported(case(head_dim=256))
    # A library before ABI 3 (no "backward" key) has no backward.
    no_bwd = "library built without backward kernels (build_info backward: false)"
    assert fa2.unsupported(case(), "bwd") == no_bwd
    assert fa2.unsupported(case(), "fwd+bwd") == no_bwd
    assert fa2.version() == "0.1.0 (abc)"


def test_backward_rows_follow_the_backward_kernel_list(monkeypatch):
    kernels = [{"backend": "fa2", "direction": "fwd", "dtype": "bf16", "head_dim": 64},
               {"backend": "fa2", "direction": "bwd", "dtype": "bf16", "head_dim": 64}]
    fake_library(monkeypatch, dict(SM80_BUILD, archs=["sm80", "sm90a"], backward=True,
                                   directions=["fwd", "bwd"], kernels=kernels))
    known = registry.known_backends()
    assert known["fa2"].unsupported(case(head_dim=64), "bwd") is None
    assert known["fa2"].unsupported(case(head_dim=64), "fwd") is None
    assert known["fa2"].unsupported(case(head_dim=128), "fwd+bwd") == (
        "library built without a fa2 backward kernel for bf16 head-dim bucket 128")
    assert known["fa3"].unsupported(case(head_dim=64), "bwd") == (
        "library built without a fa3 backward kernel for bf16 head-dim bucket 64")


def test_fa3_needs_hopper(monkeypatch):
    fake_library(monkeypatch, dict(SM80_BUILD, archs=["sm80", "sm90a"]))
    fa3 = registry.known_backends()["fa3"]
    assert fa3.probe(H100) is None
    assert fa3.probe(A100) == "needs an sm9x GPU; this one is sm80"
    assert fa3.probe((10, 0)) == "needs an sm9x GPU; this one is sm100"


def test_library_missing_is_a_reason(monkeypatch):
    fake_library(monkeypatch, OSError("libflash_hopper.so: cannot open shared object file"))
    known = registry.known_backends()
    for name in ("fa3", "fa2"):
        reason = known[name].probe(H100)
        assert reason.startswith("flash-hopper library not loadable: OSError")


def test_fa3_variants_from_build_info(monkeypatch):
    info = dict(SM80_BUILD, archs=["sm80", "sm90a"], fa3_variants=["fa3-no-pingpong"])
    fake_library(monkeypatch, info)
    known = registry.known_backends()
    assert "fa3-no-pingpong" in known
    assert known["fa3-no-pingpong"].probe(H100) is None
    assert known["fa3-no-pingpong"].path == "fa3-no-pingpong"
    chosen = registry.resolve(["all"], known)
    assert "fa3-no-pingpong" in [b.name for b in chosen]
    # A variant this build does not have is kept and explains itself instead of crashing.
    missing = registry.resolve(["fa3-no-overlap"], known)[0]
    assert "fa3-no-pingpong" in missing.probe(H100)


def test_resolve_aliases_order_and_errors():
    known = registry.known_backends(include_variants=False)
    names = [b.name for b in registry.resolve(["sdpa-cudnn", "flash_attn", "fa2", "fa2"], known)]
    assert names == ["sdpa-cudnn", "flash-attn", "fa2"]
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        registry.resolve(["nope"], known)
    assert registry.DEFAULT_BACKENDS == ("fa3", "fa2", "sdpa-flash", "sdpa-cudnn")


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
    reason = peers.FlexBackend().probe(H100)
    # torch < 2.5 has no flex_attention at all, which is reported first.
    assert "triton" in reason or "torch >= 2.5" in reason


MASKED_CASES = [  # (sq, sk, causal, window): bottom-right causal both ways, windows, one-sided
    (7, 7, True, (-1, -1)), (5, 11, True, (-1, -1)), (11, 5, True, (-1, -1)),
    (11, 5, False, (3, 0)), (7, 7, False, (2, 4)), (5, 11, True, (4, -1)), (11, 5, False, (-1, 2)),
]


@pytest.mark.parametrize("sq,sk,causal,window", MASKED_CASES)
def test_peer_masks_are_the_policy(sq, sk, causal, window):
    c = case(seqlen_q=sq, seqlen_k=sk, causal=causal, window=window)
    mask = c.attention_mask()
    assert mask == AttentionMask.from_args(sq, sk, causal, window)
    rows, cols = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    assert torch.equal(peers.flex_mask_mod(mask)(0, 0, rows, cols), mask.dense())
    # flex builds its mask by vmapping mask_mod over scalar indices: that must trace too.
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    made = flex.create_mask(peers.flex_mask_mod(mask), None, None, sq, sk, device="cpu")
    assert torch.equal(made[0, 0], mask.dense())
    assert peers.needs_mask(c)
    assert peers.SdpaBackend.explicit_mask(c) == (not (causal and window == (-1, -1) and sq == sk))


def test_unmasked_case_needs_no_mask():
    assert not peers.needs_mask(case())
    assert not peers.SdpaBackend.explicit_mask(case())


@pytest.mark.parametrize("sk,causal,window,explicit", [
    (9, True, (-1, -1), True), (9, False, (3, 1), True), (9, True, (2, -1), True),
    (5, False, (3, 1), True),
    (5, True, (-1, -1), False), (5, False, (-1, 0), False),  # square plain causal: is_causal
    (5, False, (-1, -1), False),
])
def test_sdpa_math_runs_the_policy_on_cpu(sk, causal, window, explicit):
    # sdpa-math on CPU with the policy's mask (or is_causal) equals the flash-hopper reference.
    from flash_hopper import reference

    c = case(batch=1, seqlen_q=5, seqlen_k=sk, heads=2, heads_kv=2, head_dim=16, causal=causal,
             window=window, dtype="bf16")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 2, 16, generator=gen, dtype=torch.float32)
    k = torch.randn(1, sk, 2, 16, generator=gen, dtype=torch.float32)
    v = torch.randn(1, sk, 2, 16, generator=gen, dtype=torch.float32)
    backend = peers.SdpaBackend("math")
    assert backend.kernel(q, k, v, c)[1].startswith("explicit boolean mask") == explicit
    out = backend.make_forward(q, k, v, c)()
    ref = reference.attention_ref(q, k, v, causal=causal, window_size=window)[0]
    assert out.shape == q.shape
    assert torch.allclose(out, ref, atol=1e-5)


# ---- the reference-check call ------------------------------------------------------------------


def test_our_check_call_poisons_buffers_and_runs_the_timed_path(monkeypatch):
    from flash_hopper import ops

    seen = {}

    def fake_fwd_into(q, k, v, out, lse, scale, left, right, softcap, backend, num_sms=0):
        seen.update(out_nan=bool(out.isnan().all()), lse_nan=bool(lse.isnan().all()),
                    lse_shape=tuple(lse.shape), args=(scale, left, right, softcap, backend))
        out.zero_()
        lse.zero_()
        return backend

    monkeypatch.setattr(ops, "fwd_into", fake_fwd_into)
    fa2 = backends.FlashHopperBackend("fa2", "fa2")
    q = torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 9, 2, 64, dtype=torch.bfloat16)
    c = case(seqlen_q=5, seqlen_k=9, heads=4, heads_kv=2, head_dim=64, causal=True,
             window=(3, 7), softcap=2.0)
    out, lse = fa2.run_checked(q, k, k, c)
    assert seen == {"out_nan": True, "lse_nan": True, "lse_shape": (2, 4, 5),
                    "args": (0.125, 3, 0, 2.0, "fa2")}  # causal: right bound 0
    assert out.shape == q.shape and lse.dtype == torch.float32

    monkeypatch.setattr(ops, "fwd_into", lambda *args, **kwargs: "fa3")
    with pytest.raises(RuntimeError, match="the check ran path 'fa3', but 'fa2' is timed"):
        fa2.run_checked(q, k, k, c)


def test_our_gradient_check_call_runs_bwd_into_on_the_checked_forward(monkeypatch):
    from flash_hopper import ops

    seen = {}

    def fake_fwd_into(q, k, v, out, lse, scale, left, right, softcap, backend, num_sms=0):
        out.fill_(1.0)
        lse.fill_(2.0)
        return "fa3"

    def fake_bwd_into(dout, q, k, v, out, lse, dq, dk, dv, scale, left, right, softcap,
                      backend="auto", deterministic=False, dlse=None, num_sms=0):
        seen.update(poisoned=all(bool(t.isnan().all()) for t in (dq, dk, dv)),
                    forward=(bool((out == 1).all()), bool((lse == 2).all())),
                    dout=dout is sent, args=(scale, left, right, softcap, backend))
        for t in (dq, dk, dv):
            t.zero_()
        return ran

    monkeypatch.setattr(ops, "fwd_into", fake_fwd_into)
    monkeypatch.setattr(ops, "bwd_into", fake_bwd_into)
    variant = backends.FlashHopperBackend("fa3-noping", "fa3-noping", variant=True)
    variant.path = "fa3"  # the forward's own check asserts the variant's name; not tested here
    q = torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 9, 2, 64, dtype=torch.bfloat16)
    sent = torch.ones_like(q)
    c = case(seqlen_q=5, seqlen_k=9, heads=4, heads_kv=2, head_dim=64, window=(3, 7))
    ran = "fa3"
    dq, dk, dv = variant.run_checked_backward(q, k, k, sent, c)
    assert seen == {"poisoned": True, "forward": (True, True), "dout": True,
                    "args": (0.125, 3, 7, 0.0, "fa3")}
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape

    fa2 = backends.FlashHopperBackend("fa2", "fa2")
    monkeypatch.setattr(ops, "fwd_into", lambda *args, **kwargs: "fa2")
    ran = "fa3"
    with pytest.raises(RuntimeError, match="ran backward path 'fa3', but 'fa2' is timed"):
        fa2.run_checked_backward(q, k, k, sent, c)


def test_fa3_variants_are_checked_against_the_tuned_backward():
    assert backends.FlashHopperBackend("fa3-noping", "fa3-noping", variant=True).bwd_path == "fa3"
    assert backends.FlashHopperBackend("fa3", "fa3").bwd_path == "fa3"
    assert backends.FlashHopperBackend("fa2", "fa2").bwd_path == "fa2"


def test_our_workspace_size_comes_from_the_backward_plan(monkeypatch):
    # Validation and the plan need a GPU: both stand-ins record what the timed call's plan gets.
    from flash_hopper import _bwd, _validate

    class FakePlan:
        workspace_bytes = 12345

    seen = {}

    def fake_check(dout, q, k, v, out, lse, dlse, scale, left, right, softcap, backend,
                   deterministic):
        seen["check"] = (tuple(lse.shape), lse.dtype, dlse, scale, left, right, softcap,
                         backend, deterministic)
        return "cfg"

    def fake_make_plan(cfg, dout, q, k, v, out, lse, dlse, grads=None, num_sms=0):
        seen["plan"] = (cfg, grads, dlse, num_sms)
        return FakePlan()

    monkeypatch.setattr(_validate, "check_bwd_args", fake_check)
    monkeypatch.setattr(_bwd, "make_plan", fake_make_plan)
    q = torch.zeros(2, 5, 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 9, 2, 64, dtype=torch.bfloat16)
    c = case(seqlen_q=5, seqlen_k=9, heads=4, heads_kv=2, head_dim=64, causal=True)
    assert backends.FlashHopperBackend("fa2", "fa2").bwd_workspace_bytes(q, k, k, c) == 12345
    # Like the timed call: fp32 (b, h, sq) lse, no dlse, not deterministic, fresh gradients.
    assert seen["check"] == ((2, 4, 5), torch.float32, None, 0.125, -1, 0, 0.0, "fa2", False)
    assert seen["plan"] == ("cfg", None, None, 0)
    assert peers.SdpaBackend("flash").bwd_workspace_bytes(q, k, k, c) is None


def test_peer_gradient_check_is_autograd_of_the_timed_forward():
    backend = peers.SdpaBackend("math")
    c = case(seqlen_q=6, seqlen_k=6, heads=2, heads_kv=2, head_dim=8, causal=True)
    q, k, v = (torch.randn(1, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    dout = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    got = backend.run_checked_backward(q, k, v, dout, c)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in leaves), is_causal=True).transpose(1, 2)
    expected = torch.autograd.grad(out, leaves, dout)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert not q.requires_grad  # the caller's tensors are left alone


def test_external_check_call_keeps_an_lse_of_our_layout(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn())
    backend = registry.known_backends(include_variants=False)["flash-attn"]
    assert backend.probe(H100) is None
    q = torch.zeros(2, 5, 4, 8)
    lse = torch.zeros(2, 4, 5)
    assert backend.run_checked(q, q, q, case()) == (q, None)
    backend._func = lambda q, k, v, **kw: (q, lse)
    out, got = backend.run_checked(q, q, q, case())
    assert out is q and got is lse
    backend._func = lambda q, k, v, **kw: (q, torch.zeros(3))  # not an LSE: not checked
    assert backend.run_checked(q, q, q, case())[1] is None


# ---- module layout -------------------------------------------------------------------------------


def _bench_imports() -> dict[str, set[str]]:
    """{module: bench modules it imports}, at any depth of its code (lazy imports count too)."""
    package = Path(backends.__file__).parent
    graph = {}
    for path in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module == "flash_hopper.bench":
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "flash_hopper.bench."):
                names.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = {n.split(".")[0] for n in names}
    return graph


def test_bench_modules_import_without_cycles():
    graph = _bench_imports()
    assert graph["base"] == set(), "base.py is the leaf every backend module may import"
    assert {"base"} <= graph["backends"] and {"base"} <= graph["peers"]
    assert {"backends", "peers"} <= graph["registry"]

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted(m for m in graph if m in reachable(m))
    assert cycles == []


ARGV_PARSING_PEER = """
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("-diagnostic", action="store_true")
parser.parse_args()  # argparse exits on what it does not know, as the CuTe DSL's parser did


def flash_attn_func(q, k, v, causal=False):
    return q
"""


def test_peers_import_with_argv_shielded(tmp_path, monkeypatch):
    """A regression: `flash-hopper bench -d 128 --backends flash-attn-cute` died because the
    CuTe DSL parses sys.argv on import (argparse read `-d` as a prefix of its `-diagnostic`,
    then `128` as an unknown argument). A peer module that does the same imports cleanly, and
    sys.argv is back afterwards; one that exits on import becomes a reason, not an exit."""
    (tmp_path / "argv_peer.py").write_text(ARGV_PARSING_PEER)
    (tmp_path / "exiting_peer.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["flash-hopper", "bench", "-d", "128", "--backends", "argv-peer"]
    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit):  # the negative control: unshielded, the import exits
        importlib.import_module("argv_peer")
    sys.modules.pop("argv_peer", None)
    peer = peers.FlashAttnPackage("argv-peer", "argv peer", ["argv_peer"], ["argv-peer"])
    assert peer.software_reason() is None
    assert sys.argv == argv
    exiting = peers.FlashAttnPackage("exiting", "exiting", ["exiting_peer"], ["exiting"])
    assert "exiting_peer: exited on import (SystemExit 3)" in exiting.software_reason()
    assert sys.argv == argv


# --- FlashInfer ---------------------------------------------------------------------------------


class FakeRaggedWrapper:
    """flashinfer.BatchPrefillWithRaggedKVCacheWrapper as far as the backend uses it: records
    the plan, and run() returns q (packed), so the output's layout is checkable."""

    instances: list = []

    def __init__(self, workspace, kv_layout="NHD"):
        self.workspace, self.kv_layout = workspace, kv_layout
        self.plan_args = None
        FakeRaggedWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, **kwargs):
        self.plan_args = (qo_indptr.tolist(), kv_indptr.tolist(), num_qo_heads, num_kv_heads,
                          head_dim, kwargs)

    def run(self, q, k, v):
        assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3  # packed (tokens, heads, d)
        return q


def fake_flashinfer():
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithRaggedKVCacheWrapper = FakeRaggedWrapper
    return module


def test_flashinfer_plans_a_dense_batch_as_equal_sequences(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    backend = registry.resolve(["flashinfer-python"],
                               registry.known_backends(include_variants=False))[0]
    assert backend.name == "flashinfer" and backend.probe(H100) is None
    q = torch.randn(2, 5, 4, 8)
    k = v = torch.randn(2, 7, 2, 8)
    c = case(seqlen_q=5, seqlen_k=7, heads=4, heads_kv=2, head_dim=8, causal=True, softcap=30.0)
    out = backend.make_forward(q, k, v, c)()
    assert out.shape == q.shape and torch.equal(out, q)
    qo, kv, hq, hk, d, kwargs = FakeRaggedWrapper.instances[-1].plan_args
    assert (qo, kv, hq, hk, d) == ([0, 5, 10], [0, 7, 14], 4, 2, 8)
    assert kwargs["causal"] is True and kwargs["logits_soft_cap"] == 30.0
    assert "window_left" not in kwargs


def test_flashinfer_takes_varlen_offsets_and_left_windows_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    backend = registry.known_backends(include_variants=False)["flashinfer"]
    c = Case(batch=3, seqlen_q=9, seqlen_k=9, heads=2, heads_kv=2, head_dim=16,
             seqlens=(9, 4, 2), window=(3, 0))
    assert backend.varlen_reason() is None and backend.unsupported(c) is None
    q = torch.randn(15, 2, 16)
    assert torch.equal(backend.make_forward(q, q, q, c)(), q)
    qo, kv, _, _, _, kwargs = FakeRaggedWrapper.instances[-1].plan_args
    assert qo == kv == [0, 9, 13, 15]
    assert kwargs["causal"] is True and kwargs["window_left"] == 3  # (3, 0): causal, left 3
    assert "right bound" in backend.unsupported(case(window=(3, 5)))
    assert backend.unsupported(case(), "bwd") == "FlashInfer has no backward"
    assert backend.fp8_reason() == "no FP8 path"


def test_flashinfer_missing_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    backend = registry.known_backends(include_variants=False)["flashinfer"]
    assert backend.probe(H100).startswith("not importable (flashinfer:")
    old = types.ModuleType("flashinfer")  # a release without the ragged wrapper
    monkeypatch.setitem(sys.modules, "flashinfer", old)
    assert "BatchPrefillWithRaggedKVCacheWrapper" in backend.probe(H100)
