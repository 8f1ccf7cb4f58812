"""`flash-hopper demo` (and `python -m flash_hopper demo`): one flash_attn_func call on the GPU.

Prints the path taken and why, the max errors of the output and the LSE against the float32
reference with the tolerance rule's verdict (check.py), and the median time: the smallest proof
that the install works.
"""

from __future__ import annotations

from . import check, env
from .cases import Case
from .errors import first_line
from .timing import Timer, TimerConfig


class DemoError(RuntimeError):
    """A one-line reason the demo cannot run here (no GPU, no library)."""


def run_demo(args) -> int:
    gpu, reason = env.detect_gpu()
    if gpu is None:
        raise DemoError(f"needs a CUDA GPU: {reason}")
    import torch

    try:
        import flash_hopper

        flash_hopper.build_info()
    except Exception as exc:
        raise DemoError(f"flash-hopper library not usable: {first_line(exc)}") from exc

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    case = Case(batch=args.batch, seqlen_q=args.seqlen, seqlen_k=args.seqlen, heads=args.heads,
                heads_kv=args.heads, head_dim=args.head_dim, causal=args.causal, dtype=args.dtype)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    kwargs = {"causal": args.causal, "backend": args.backend}
    try:
        path, why = flash_hopper.which_backend(q, k, v, **kwargs)
        out, lse = flash_hopper.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    except Exception as exc:
        raise DemoError(first_line(exc)) from exc
    result = check.References(q, k, v, case).check(out, lse)
    stats = Timer(TimerConfig(warmup=5, repeats=20)).measure(
        [lambda: flash_hopper.flash_attn_func(q, k, v, **kwargs)])
    flops = case.flops()
    print(f"flash_attn_func on {gpu.name} ({gpu.arch}): q, k, v {tuple(shape)} {args.dtype}, "
          f"causal={args.causal}")
    print(f"  path : {path} ({why})")
    print(f"  error: max |out - ref_fp32| = {result.err:.2e}; same-precision torch reference "
          f"{result.ref_err:.2e}; tolerance {result.tol:.2e}; max |lse - ref_fp32| = "
          f"{result.lse_err:.2e} (tolerance {result.lse_tol:.0e}) -> "
          f"{'PASS' if result.passed else 'FAIL'}")
    print(f"  time : {stats.median:.3f} ms median of {stats.n} "
          f"({stats.p20:.3f}-{stats.p80:.3f} p20-p80), "
          f"{flops / (stats.median * 1e-3) / 1e12:.1f} TFLOP/s")
    return 0 if result.passed else 1
