"""Small helpers shared by the test modules (imported as a sibling module)."""

from __future__ import annotations

import math
import re

import pytest
import torch


def raises(exc, *fragments):
    """pytest.raises requiring every fragment somewhere in the message (in any order)."""
    return pytest.raises(exc, match="".join(f"(?=[\\s\\S]*{re.escape(f)})" for f in fragments))


class StandInTimer:
    """bench's timing.Timer stand-in for whole-command tests with the GPU mocked: runs each
    callable once (so failures surface) and reports a fixed, synthetic time."""

    def __init__(self, config, device=None):
        self.config = config

    def sets_for(self, nbytes):
        return 1

    def describe(self):
        return {"method": "stand-in"}

    def measure(self, fns):
        from flash_hopper.bench.timing import Stats

        for fn in fns:
            fn()
        return Stats(median=1.0, p20=0.9, p80=1.1, min=0.8, max=1.2, mean=1.0, n=3)


def fake_build_info(monkeypatch, info):
    """flash_hopper.build_info() answers ``info`` (a fresh copy per call): a library of that build
    for the bench backends' capability checks, with none loaded."""
    import flash_hopper

    monkeypatch.setattr(flash_hopper, "build_info", lambda: dict(info))


def mock_h200_bench(monkeypatch):
    """The bench command's GPU mocked for whole-command tests: an H200 as env.detect_gpu's answer,
    StandInTimer for timing.Timer, runs on CPU tensors. Returns the mocked GpuInfo."""
    import functools

    from flash_hopper.bench import env, runner, timing

    gpu = env.GpuInfo(index=0, name="NVIDIA H200", capability=(9, 0), sm_count=132,
                      memory_bytes=141 << 30, l2_bytes=60 << 20)
    monkeypatch.setattr(env, "detect_gpu", lambda index=None: (gpu, ""))
    monkeypatch.setattr(timing, "Timer", StandInTimer)
    monkeypatch.setattr(runner, "RunOptions", functools.partial(runner.RunOptions, device="cpu"))
    return gpu


class FixedTimer:
    """bench's timing.Timer stand-in for runner tests on CPU: runs each callable once and reports
    a fixed 2 ms."""

    def sets_for(self, nbytes):
        return 2

    def measure(self, fns):
        from flash_hopper.bench.timing import Stats

        for fn in fns:
            fn()
        return Stats(median=2.0, p20=1.9, p80=2.1, min=1.8, max=2.5, mean=2.0, n=10)


def run_on_cpu(backends_, cases, **options):
    """bench's Runner over ``cases`` with the FixedTimer, on the CPU: the result rows."""
    from flash_hopper.bench.runner import Runner, RunOptions

    return Runner(backends_, FixedTimer(), RunOptions(device="cpu", **options)).run(list(cases))



def emulated_attention(qh, kh, vh, scale, causal, window_size, p_dtype, out_scale=1.0,
                       error=None):
    """The bench tests' CPU stand-in for a kernel: heads-first fp32 q / k / v (b, h, s, d),
    scores times ``scale`` (a float or per-head (b, h, 1, 1)), the mask, P = exp(s - max) rounded
    to ``p_dtype`` for P V and unrounded in the row sum, the output times ``out_scale``, then
    ``error`` (a function standing in for a bug). Returns (out (b, h, sq, d) fp32, lse (b, h, sq))."""
    from flash_hopper.mask import AttentionMask

    scores = (qh @ kh.transpose(-1, -2)) * scale
    mask = AttentionMask.from_args(qh.shape[2], kh.shape[2], causal, window_size)
    if not mask.is_full:
        scores = scores.masked_fill(~mask.dense(), -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(-1, keepdim=True)
    out = (p.to(p_dtype).float() @ vh) / row_sum * out_scale
    if error is not None:
        out = error(out)
    return out, (row_max + row_sum.log()).squeeze(-1)


def check_kvcache(out, lse, ref_out, ref_lse, low_out):
    """FA3's rule for a KV-cache call: no NaN (a cache's unused slots hold NaN), the max error at
    most twice the input-dtype computation's plus 2e-3, the LSE's finite entries where the
    reference's are and within 1e-3."""
    assert not out.isnan().any(), "NaN from the cache's unused slots reached the output"
    err = (out.double() - ref_out).abs().max().item()
    low = (low_out.double() - ref_out).abs().max().item()
    assert err <= 2 * low + 2e-3, (err, low)
    if lse is not None:
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        if finite.any():
            assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 1e-3


def kvcache_references(q, kc, vc, kn=None, vn=None, **kw):
    """(float64 out, lse, caches after the append) and the input-dtype computation's out, for a
    flash_attn_with_kvcache call (reference.attention_kvcache_ref). NaN in the caches' unused
    slots becomes 0 for the reference (it must never matter)."""
    from flash_hopper.reference import attention_kvcache_ref

    k0, v0 = (torch.nan_to_num(t, nan=0.0) for t in (kc, vc))
    ref_out, ref_lse, k1, v1 = attention_kvcache_ref(
        q.double(), k0.double(), v0.double(), None if kn is None else kn.double(),
        None if vn is None else vn.double(), **kw)
    low_out = attention_kvcache_ref(q, k0, v0, kn, vn, upcast=False, **kw)[0]
    return ref_out, ref_lse, k1, v1, low_out


def skip_without_kernel(lib, head_dim: int, backward: bool = False, fa3_only: bool = False) -> None:
    """Skip when the library holds no bf16 kernel of head_dim on either path (a reduced build:
    FH_HEAD_DIMS, FH_ARCHS); with backward, also none of the backward; with fa3_only, the FA-3
    path's kernels are the ones required (a test of that path's launches)."""
    from flash_hopper._lib import FhBackend, FhDtype

    paths = (FhBackend.FA3,) if fa3_only else (FhBackend.FA2, FhBackend.FA3)
    if not any(lib.has_fwd_kernel(be, FhDtype.BF16, head_dim) for be in paths):
        pytest.skip(f"this build has no bf16 head_dim {head_dim} forward kernel")
    if backward and not any(lib.has_bwd_kernel(be, FhDtype.BF16, head_dim) for be in paths):
        pytest.skip(f"this build has no bf16 head_dim {head_dim} backward kernel")


def kernel_ctas(fn, tmp_path, names=("fwd_kernel", "bwd_kernel")) -> dict:
    """{kernel: the most CTAs one launch of it had} for the kernels ``fn`` launches whose name
    has one of ``names`` (torch.profiler's trace of their grids)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    trace = tmp_path / "kernel_ctas.json"
    prof.export_chrome_trace(str(trace))
    ctas = {}
    for e in json.loads(trace.read_text())["traceEvents"]:
        if e.get("cat") == "kernel" and any(n in e["name"] for n in names):
            grid = e["args"]["grid"]
            name = e["name"].split("<")[0].split()[-1]
            ctas[name] = max(ctas.get(name, 0), grid[0] * grid[1] * grid[2])
    return ctas
