"""`flash-hopper demo` (and `python -m flash_hopper demo`): one flash_attn_func call on the GPU.

Prints the path taken and why, the max error against the float32 reference with the tolerance
rule's verdict, and the median time: the smallest proof that the install works.
"""

from __future__ import annotations

from . import check, env
from .errors import first_line
from .flops import attention_flops
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
        from flash_hopper.reference import attention_ref

        flash_hopper.build_info()
    except Exception as exc:
        raise DemoError(f"flash-hopper library not usable: {first_line(exc)}") from exc

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    kwargs = {"causal": args.causal, "backend": args.backend}
    try:
        path, why = flash_hopper.which_backend(q, k, v, **kwargs)
        out = flash_hopper.flash_attn_func(q, k, v, **kwargs)
    except Exception as exc:
        raise DemoError(first_line(exc)) from exc
    ref_fp32 = attention_ref(q, k, v, causal=args.causal, upcast=True)[0]
    ref_lowp = attention_ref(q, k, v, causal=args.causal, upcast=False)[0]
    result = check.compare(out, ref_fp32, ref_lowp)
    stats = Timer(TimerConfig(warmup=5, repeats=20)).measure(
        [lambda: flash_hopper.flash_attn_func(q, k, v, **kwargs)])
    flops = attention_flops(args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim,
                            args.causal)
    print(f"flash_attn_func on {gpu.name} ({gpu.arch}): q, k, v {tuple(shape)} {args.dtype}, "
          f"causal={args.causal}")
    print(f"  path : {path} ({why})")
    print(f"  error: max |out - ref_fp32| = {result.err:.2e}; same-precision torch reference "
          f"{result.ref_err:.2e}; tolerance {result.tol:.2e} -> "
          f"{'PASS' if result.passed else 'FAIL'}")
    print(f"  time : {stats.median:.3f} ms median of {stats.n} "
          f"({stats.p20:.3f}-{stats.p80:.3f} p20-p80), "
          f"{flops / (stats.median * 1e-3) / 1e12:.1f} TFLOP/s")
    return 0 if result.passed else 1
