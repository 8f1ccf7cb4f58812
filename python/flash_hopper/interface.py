"""Public API, FlashAttention-3 compatible: flash_attn_func and which_backend.

flash_attn_func validates (metadata only) and calls the ``flash_hopper::fwd`` custom op, so
``torch.compile(flash_attn_func, fullgraph=True)`` traces it without graph breaks: no ctypes,
device query or data-dependent Python runs until the op's real implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _validate, ops


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    return_attn_probs: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, forward.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16 on one CUDA device, head_dim a multiple of 8 up to 256, heads_q % heads_kv == 0 (GQA/MQA).

    softmax_scale: defaults to 1/sqrt(head_dim); applied to q.k before ``softcap``.
    causal / window_size=(left, right): query i sees key j iff
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
    (bottom-right aligned; -1 = unbounded); causal=True is right = 0. A row that sees no key gets
    out 0 and lse -inf.
    softcap: if > 0, score = softcap * tanh(score / softcap).
    return_attn_probs: also return lse, fp32 (batch, heads_q, seqlen_q), natural log (FA3 returns
    the LSE here, not the probabilities).
    backend: "auto" (FA-3 path on cc 9.0 when built, else FA-2 path), "fa2" or "fa3".

    Pass the arguments after v by keyword: FA3's positional order has extra parameters.
    Forward only for now: backward raises NotImplementedError.
    """
    cfg = _validate.check_fwd_args(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, backend=backend,
    )
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs: expected a bool, got {return_attn_probs!r}")
    args = (q, k, v, cfg.softmax_scale, cfg.window_left, cfg.window_right, cfg.softcap,
            cfg.backend)
    # The custom op is what torch.compile / make_fx trace and what autograd sees; in plain eager
    # inference on real tensors it only adds dispatch overhead, so call its implementation.
    if _plain_eager_inference(q, k, v):
        out, lse = ops.fwd_validated(q, k, v, cfg)
    else:
        out, lse = ops.fwd(*args)
    return (out, lse) if return_attn_probs else out


def _plain_eager_inference(*tensors: torch.Tensor) -> bool:
    """True when no tracer, tensor subclass, dispatch mode or autograd needs to see the op."""
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    if any(type(t) is not torch.Tensor for t in tensors):  # FakeTensor, FunctionalTensor, ...
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def which_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    backend: str = "auto",
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
) -> tuple[str, str]:
    """(backend, reason) flash_attn_func would use for these arguments, without launching.

    Raises like flash_attn_func would (invalid arguments, no kernel for this GPU/build).
    """
    cfg = _validate.check_fwd_args(
        q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, backend=backend,
    )
    return ops.resolve_backend(
        q.device, cfg.dtype, cfg.head_dim, cfg.backend,
        _validate.tma_layout_problem(q=q, k=k, v=v),
    )
