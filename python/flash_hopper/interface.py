"""Public API, FlashAttention-3 compatible: flash_attn_func, flash_attn_varlen_func,
flash_attn_qkvpacked_func and which_backend.

Three ways down, one host path per direction (_fwd.py, _bwd.py):
- plain eager inference (real tensors, no tracer, no input that needs a gradient): straight to
  ``_fwd.eager``, which validates once per call signature, asks the library's policy, fills the
  parameters and launches; no LSE is allocated unless it is returned;
- plain eager training (real tensors, no tracer, grad enabled and some input requiring grad):
  ``_autograd.FlashAttnFunction``, a torch.autograd.Function over the same host paths (no
  custom-op dispatch);
- anything torch must see (torch.compile, make_fx, FakeTensors, dispatch modes): validate here
  (metadata only) and call the ``flash_hopper::fwd`` custom op, so ``torch.compile(
  flash_attn_func, fullgraph=True)`` traces it without graph breaks; its registered autograd
  puts ``flash_hopper::bwd`` in the backward graph.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _autograd, _chunk, _dv, _fwd, _qv, _validate, _varlen, ops
from ._errors import UnsupportedError
from ._tables import FP8_DTYPES, KV_FP8_DTYPES, TORCH_DTYPES


def _with_sinks(call, sinks, q, heads_dim: int, return_attn_probs: bool):
    """A call with per-head sink logits from ``call()``, the same call without them returning
    (out, lse) with the heads on lse's dim ``heads_dim``: exact (kvcache.apply_sinks), and
    differentiable through the call's LSE. sinks are checked before the call runs."""
    from .kvcache import apply_sinks, check_sinks  # kvcache builds on this module's siblings

    sinks = check_sinks(sinks, q)
    result, lse = call()
    result, lse = apply_sinks(result, lse, sinks, heads_dim)
    return (result, lse) if return_attn_probs else result


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
    fp8_accumulation: str = "two-level",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, differentiable with respect to q, k and v.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), fp16 or
    bf16 on one CUDA device, head_dim a multiple of 8 up to 256, heads_q % heads_kv == 0 (GQA/MQA).

    softmax_scale: defaults to 1/sqrt(head_dim); applied to q.k before ``softcap``.
    causal / window_size=(left, right): query i sees key j iff
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right
    (bottom-right aligned; any negative bound = unbounded); causal=True sets right = 0 whatever
    window_size says (FA3's rule). The pair may be a 2-element integer tensor. A row that sees no
    key gets out 0 and lse -inf.
    softcap: if > 0, score = softcap * tanh(score / softcap).
    deterministic: make the backward's dq bitwise reproducible (dk and dv always are), at a small
    cost in backward speed; the forward is deterministic either way.
    return_attn_probs: also return lse, fp32 (batch, heads_q, seqlen_q), natural log (FA3 returns
    the LSE here, not the probabilities); a loss that uses it gets its gradient too.
    sinks (keyword only): fp32 (heads_q,) on q's device, one logit per query head that joins
    every row's softmax denominator without a value (gpt-oss's attention sinks, FA4's
    learnable_sink): out = softmax([scores, sink]) V over the keys, lse = logaddexp(lse, sink); a
    row that sees no key gets out 0 and lse = sink. Differentiable with respect to sinks too:
    computed exactly from the call without sinks and its LSE (the backward takes the LSE's
    gradient), so it runs wherever that call runs.
    backend (keyword only): "auto" (FA-3 path on cc 9.0 when built, else FA-2 path), "fa2",
    "fa3", or an FA-3 ablation variant ("fa3-no-pingpong", ...; build_info()["fa3_variants"]
    lists the built ones).
    The backward runs on the backend asked for ("auto": the backward's own choice; the FA-3
    ablation variants train with the tuned FA-3 backward). The FA-3 path's backward has tiles
    for every head-dim bucket: "auto" trains on it on cc 9.0 where this build has its kernel
    and q / k / v / dout load with TMA, else on the FA-2 path; an explicit "fa3" that cannot
    run raises when the backward runs, naming why.

    Gradients: dq, dk, dv in q/k/v's dtypes (fresh contiguous tensors, summed over the query heads
    of a kv head for GQA); rows that see no key and keys no query sees get exact zeros.

    The parameters are FA3's flash_attn_func's, in its order and with its defaults (FA3's tests
    and inference servers call it positionally too).
    qv (MLA's extra query, FA3's semantics): (batch, seqlen_q, heads_q, dv) with q's dtype
    (fp16 / bf16; FP8 q takes no qv) and device, last dim contiguous; q / k of head dim d <= 64,
    v and qv of dv in [256, 512] (multiples of 8); GQA / MQA as above. The scores become
    softmax_scale * (q . k + qv . v), softcap on that sum, then the masks (causal, window,
    attention_chunk); out is (batch, seqlen_q, heads_q, dv), lse as above. softmax_scale
    defaults to 1 / sqrt(d + dv) with qv. qv runs a composite path of torch GEMMs (_qv.py:
    online softmax over key blocks in fp32, memory bounded by the block sizes), not a fused
    kernel yet, on q's device (any device torch runs on; backend must be "auto"). It is
    differentiable: autograd gives exact gradients for q, k, v and qv (FA3 has no backward for
    qv). num_splits, pack_gqa, sm_margin and deterministic do not change it.
    v may have a head dim of its own (FA3's dv != d, e.g. 192 / 128, 64 / 256 or 512; a
    multiple of 8): out is (batch, seqlen_q, heads_q, dv); the default softmax_scale stays
    1 / sqrt(d). DeepSeek's d 192 / dv 128 (d in 136..192, dv in
    104..128), fp16 / bf16 on cc 9.0 without grad, runs the FA-3 path's kernel with V's own
    head dim; every other call is
    served by zero padding q / k to max(d, min(dv, 256)) and cutting V into blocks of that width
    (_dv.py; exact, one call for dv <= 256), with gradients.
    attention_chunk (FA3's chunked-local attention, Llama 4's): > 0 lets query row i see only the
    keys j with floor((i + seqlen_k - seqlen_q) / chunk) == floor(j / chunk), on top of causal /
    window_size; 0 = off. Forward and backward on fp16 / bf16, forward on e4m3 with the default
    out_dtype / fp8_accumulation (the chunks run as the pieces of one varlen call, each taking
    its sequence's descales, _chunk.py); the mixed mode refuses it.
    sm_margin: SMs the persistent kernels leave free, forward and backward (FA3's: room for
    communication kernels running beside attention; a kernel on every SM keeps another stream's
    kernel waiting until it ends); 0 uses every SM; at least the device's SM count raises.
    Performance hints that do not change the result are accepted and, for now, not used:
    num_splits (the FA paths do not split the keys; the decode kernel that serves short queries
    under "auto" picks its own splits), pack_gqa; sm_margin by the FP8 forward
    and the short-query decode kernel (not persistent: its CTAs end within microseconds).
    backend (keyword only, this package's): see above.

    FP8 (FA3 / vLLM conventions): q, k, v in torch.float8_e4m3fn (every head-dim bucket, a multiple
    of 16) run the FA-3 path's FP8 forward on cc 9.0. q_descale / k_descale / v_descale:
    fp32 factors that turn the stored values back into the real ones, shape (batch, heads_kv)
    with any strides (``scale.expand(b, h_kv)`` works), or 0-d / (1,) to broadcast; None = 1.0.
    The scores are q_descale * k_descale * (q . k) * softmax_scale, the output is scaled by
    v_descale. As in FA3, descales passed with fp16 / bf16 inputs are ignored. out_dtype (keyword
    only): torch.bfloat16 (default) or torch.float16.
    fp8_accumulation (keyword only): "two-level" (default: each key block's P V is added into an
    fp32 output in registers, accurate at long context) or "single-level" (the tensor core's
    accumulator carries the whole sum: the ablation). FP8 calls have no backward; under
    torch.compile they are the ``flash_hopper::fwd_fp8`` custom op. flash_hopper.fp8 has
    quantize() and hadamard_rotate().

    Mixed mode (an FP8 K/V cache with fp16 / bf16 queries): q in torch.float16 / torch.bfloat16,
    k and v both in torch.float8_e4m3fn or both in torch.float8_e5m2 (head_dim 64, 128 or 256
    buckets, a multiple of 16; FA-3 path, cc 9.0). K and V are read from memory in FP8 and
    converted exactly to q's dtype in shared memory; the GEMMs are 16-bit. k_descale / v_descale
    as above; q_descale must be None; out in q's dtype. Same as the 16-bit call on
    ``k.to(q.dtype) * k_descale`` and ``v.to(q.dtype) * v_descale`` up to the 16-bit rounding of
    that product. No backward (inference).
    """
    if sinks is not None:
        _check_flags(return_attn_probs, deterministic)
        return _with_sinks(
            lambda: flash_attn_func(q, k, v, softmax_scale, causal, qv, q_descale, k_descale,
                                    v_descale, window_size, attention_chunk, softcap, num_splits,
                                    pack_gqa, deterministic, sm_margin, True, backend=backend,
                                    out_dtype=out_dtype, fp8_accumulation=fp8_accumulation),
            sinks, q, 1, return_attn_probs)
    if attention_chunk != 0 or num_splits != 1 or pack_gqa is not None or sm_margin != 0:
        _validate.check_fa3_extras(attention_chunk, num_splits, pack_gqa, sm_margin,
                                   chunk_served=True)
    if qv is not None:  # MLA's extra query: the composite path (_qv.py)
        _check_flags(return_attn_probs, deterministic)
        return _qv.func_forward(q, k, v, qv, softmax_scale, causal, window_size, softcap,
                                attention_chunk, backend, return_attn_probs, out_dtype,
                                fp8_accumulation)
    fp8 = _fp8_call(q, k)
    if not fp8 and _dv.differs(q, v):  # a V head dim of its own (_dv.py)
        _check_flags(return_attn_probs, deterministic)
        if (attention_chunk == 0 and out_dtype is None and fp8_accumulation == "two-level"
                and q_descale is None and k_descale is None and v_descale is None
                and _plain_eager(q, k, v) and _dv.native_serves(q, k, v, backend)):
            return _dv.native_forward(q, k, v, softmax_scale, causal, window_size, softcap,
                                      backend, return_attn_probs, sm_margin)
        return _dv.split_call(flash_attn_func, q, k, v, softmax_scale, return_attn_probs,
                              causal=causal, qv=qv, window_size=window_size,
                              attention_chunk=attention_chunk, softcap=softcap,
                              num_splits=num_splits, pack_gqa=pack_gqa,
                              deterministic=deterministic, sm_margin=sm_margin, backend=backend,
                              out_dtype=out_dtype, fp8_accumulation=fp8_accumulation)
    if attention_chunk:
        fp8_q = getattr(q, "dtype", None) in FP8_DTYPES
        if (fp8 and not fp8_q) or out_dtype is not None or fp8_accumulation != "two-level":
            raise UnsupportedError(f"attention_chunk: expected 0 with 16-bit q against FP8 k / v "
                                   f"or FP8 options (chunked-local attention runs on fp16 / bf16 "
                                   f"and on e4m3 with the default out_dtype and "
                                   f"fp8_accumulation), got {attention_chunk}")
        _check_flags(return_attn_probs, deterministic)
        result = _chunk.forward(q, k, v, int(attention_chunk), softmax_scale, causal,
                                window_size, softcap, backend, deterministic, sm_margin,
                                return_attn_probs, _plain_eager(q, k, v),
                                (q_descale, k_descale, v_descale) if fp8 else None)
        if result is not None:
            return result
    if fp8 or out_dtype is not None or fp8_accumulation != "two-level":
        if not fp8:
            _validate.check_not_fp8_extras(q, q_descale, k_descale, v_descale, out_dtype,
                                           fp8_accumulation)
        else:
            return _fp8_forward(q, k, v, softmax_scale, causal, window_size, softcap, backend,
                                q_descale, k_descale, v_descale, out_dtype, fp8_accumulation,
                                return_attn_probs)
    _check_flags(return_attn_probs, deterministic)
    # The custom ops are what torch.compile / make_fx trace; on real tensors in plain eager mode
    # they only add dispatch overhead, so take the host paths directly.
    if _plain_eager(q, k, v):
        if not (torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad)):
            out, lse = _fwd.eager(q, k, v, softmax_scale, causal, window_size, softcap, backend,
                                  need_lse=return_attn_probs, sm_margin=sm_margin)
        else:
            out, lse = _autograd.FlashAttnFunction.apply(
                q, k, v, softmax_scale, causal, window_size, softcap, backend, deterministic,
                sm_margin)
    else:
        cfg = _validate.check_fwd_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                       backend)
        out, lse = ops.fwd(q, k, v, cfg.softmax_scale, cfg.window_left, cfg.window_right,
                           cfg.softcap, cfg.backend, deterministic, sm_margin)
    return (out, lse) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a batch of sequences of different lengths packed along one token axis
    (FA3's flash_attn_varlen_func: its parameters, order and defaults), differentiable.

    q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim), fp16 or bf16 on one CUDA
    device. cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) on q's device, sequence b at tokens
    [cu_seqlens[b], cu_seqlens[b + 1]) (non-decreasing, the last <= the tensor's tokens; gaps
    between sequences are allowed and never read). seqused_q / seqused_k: int32 (batch,), the
    used prefix of each span (padded layouts); None = the whole span. max_seqlen_q / max_seqlen_k
    are hints (ints): a checked call takes the longest sequence; unchecked (below), short
    queries on the decode kernel cover max_seqlen_q tokens of each sequence and its rows past
    that get out 0 and lse -inf.
    causal / window_size / softcap / softmax_scale as in flash_attn_func, applied per sequence
    and bottom-right aligned on its own lengths; GQA as there. A sequence without keys gets out 0
    and lse -inf; one without queries computes nothing. Rows of out / lse outside every used span
    are not written (out= keeps what was there; a fresh out holds uninitialized values there).
    return_attn_probs: also return lse, fp32 (heads_q, total_q).
    out (keyword only): write the result into this (total_q, heads_q, head_dim) tensor of q's
    dtype (inference: no copy); not with inputs that require grad.
    backend (keyword only): as in flash_attn_func (the FA-3 ablation kernels are dense only).
    sinks (keyword only): as in flash_attn_func, one logit per query head for every sequence;
    not with out.

    The offsets' values are checked before launching (one small device-to-host copy per call:
    non-decreasing, within the tensors, seqused within its span), except while a CUDA graph is
    being captured or with FLASH_HOPPER_CHECK_OFFSETS=0; the kernels clamp every offset to the
    tensors, so unchecked bad offsets give wrong results but never touch memory outside them.
    The backward runs the dense backward kernels once per sequence (exact; it reads the offsets
    on the host). FP8: torch.float8_e4m3fn q, k, v (FA-3 path, eager, no backward) with
    q_descale / k_descale / v_descale fp32 (batch, heads_kv) as in flash_attn_func (batch = the
    sequences), out in bf16. attention_chunk as in flash_attn_func, per sequence (fp16 / bf16 /
    e4m3, eager: the offsets are read back to split the sequences into chunks). Not implemented
    yet, refused naming the argument: 16-bit q against FP8 k / v (the mixed mode) in varlen.
    v (total_k, heads_kv, dv) may have a head dim of its own as in flash_attn_func (d 192 / dv
    128 inference calls on the kernel with V's own head dim, the rest zero-padded); out is then
    (total_q, heads_q, dv). sm_margin as in
    flash_attn_func (forward and the per-sequence backward). Performance hints accepted and not
    used: num_splits, pack_gqa. Descales passed with fp16 / bf16 inputs are ignored, as in FA3.
    qv (MLA's extra query): (total_q, heads_q, dv), rows as q's; k (total_k, heads_kv, d), v
    (total_k, heads_kv, dv); out (total_q, heads_q, dv). As in flash_attn_func (its shapes,
    default scale 1 / sqrt(d + dv), masks per sequence, attention_chunk without a read-back,
    gradients): a composite path of torch GEMMs, not a fused kernel yet. Its work is padded to
    the longest sequence of the batch (the loops run to the longest spans, read with the
    offsets' check; unchecked, to max_seqlen_q / max_seqlen_k).
    """
    if sinks is not None:
        _check_flags(return_attn_probs, deterministic)
        if out is not None:  # rows outside the spans must keep what out held: the LSE there is
            # not written, so the sink's factor is unknown there
            raise UnsupportedError("out: expected None with sinks (a given out keeps its rows "
                                   "outside the sequences, which the sinks' rescaling cannot "
                                   "tell apart), got a tensor")
        return _with_sinks(
            lambda: flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, seqused_q, seqused_k, softmax_scale,
                                           causal, qv, q_descale, k_descale, v_descale,
                                           window_size, attention_chunk, softcap, num_splits,
                                           pack_gqa, deterministic, sm_margin, True,
                                           backend=backend),
            sinks, q, 0, return_attn_probs)
    if attention_chunk != 0 or num_splits != 1 or pack_gqa is not None or sm_margin != 0:
        _validate.check_fa3_extras(attention_chunk, num_splits, pack_gqa, sm_margin,
                                   chunk_served=True)
    _check_flags(return_attn_probs, deterministic)
    grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, qv))
    if out is not None and grad:
        raise UnsupportedError("out: expected None when q, k, v or qv requires grad (a result "
                               "written into a given tensor has no autograd history)")
    if qv is not None:  # MLA's extra query: the composite path (_qv.py)
        return _qv.varlen_forward(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal,
                                  window_size, softcap, attention_chunk, backend, out,
                                  return_attn_probs)
    fp8 = getattr(q, "dtype", None) in FP8_DTYPES
    if not fp8 and _dv.differs(q, v):  # a V head dim of its own (_dv.py)
        if (attention_chunk == 0 and q_descale is None and k_descale is None
                and v_descale is None and _plain_eager(q, k, v)
                and _dv.native_serves(q, k, v, backend)):
            result, lse, _ = _varlen.forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                seqused_k, softmax_scale, causal, window_size, softcap, backend, out,
                need_lse=return_attn_probs, sm_margin=sm_margin, own_head_dim_v=True)
            return (result, lse) if return_attn_probs else result

        def call(qq, kk, vv, **kw):
            return flash_attn_varlen_func(qq, kk, vv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, seqused_q, seqused_k, **kw)

        result = _dv.split_call(call, q, k, v, softmax_scale, return_attn_probs, causal=causal,
                                qv=qv, window_size=window_size,
                                attention_chunk=attention_chunk, softcap=softcap,
                                num_splits=num_splits, pack_gqa=pack_gqa,
                                deterministic=deterministic, sm_margin=sm_margin,
                                backend=backend)
        if out is None:
            return result
        if tuple(out.shape) != tuple(q.shape[:-1]) + (v.shape[-1],):
            raise ValueError(f"out: expected shape {tuple(q.shape[:-1]) + (v.shape[-1],)} "
                             f"(total_q, heads_q, v's head dim), got {tuple(out.shape)}")
        out.copy_(result[0] if return_attn_probs else result)
        return (out, result[1]) if return_attn_probs else out
    if attention_chunk:
        if not _plain_eager(q, k, v):
            raise UnsupportedError(f"attention_chunk: expected 0 under torch.compile / tracing "
                                   f"(varlen chunks are split on the host, eagerly), got "
                                   f"{attention_chunk}")
        result, lse = _chunk.varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
            seqused_k, int(attention_chunk), softmax_scale, causal, window_size, softcap,
            backend, deterministic, sm_margin, out, grad,
            (q_descale, k_descale, v_descale) if fp8 else None)
        return (result, lse) if return_attn_probs else result
    if fp8 and not _plain_eager(q, k, v):
        raise UnsupportedError("q: FP8 varlen runs eagerly only (no flash_hopper custom op "
                               "takes it under torch.compile / tracing yet)")
    if _plain_eager(q, k, v):
        if fp8 or not grad:
            def run():
                result, lse, _ = _varlen.forward(
                    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                    seqused_k, softmax_scale, causal, window_size, softcap, backend, out=out,
                    need_lse=return_attn_probs,
                    descales=(q_descale, k_descale, v_descale) if fp8 else (None, None, None),
                    sm_margin=sm_margin)
                return result, lse
            # FP8 inputs that require grad: the forward runs, a backward raises (FA3's way)
            result, lse = _autograd.ForwardOnly.apply(run, q, k, v) if grad else run()
        else:
            result, lse = _autograd.FlashAttnVarlenFunction.apply(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                seqused_k, softmax_scale, causal, window_size, softcap, backend, deterministic,
                sm_margin)
    else:
        if out is not None:
            raise UnsupportedError("out: expected None under torch.compile / tracing (the "
                                   "flash_hopper::fwd_varlen op returns a fresh tensor)")
        vc = _varlen.check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_q, seqused_k, softmax_scale, causal, window_size,
                                softcap, backend)
        cfg = vc.cfg
        result, lse = ops.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                     max_seqlen_q, max_seqlen_k, cfg.softmax_scale,
                                     cfg.window_left, cfg.window_right, cfg.softcap, cfg.backend,
                                     deterministic, sm_margin)
    return (result, lse) if return_attn_probs else result


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    window_size: Sequence[int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    deterministic: bool = False,
    num_heads_q: int | None = None,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Self-attention on q, k and v stacked in one tensor (FA3's flash_attn_qkvpacked_func: its
    parameters, order and defaults), differentiable with respect to qkv.

    qkv: (batch, seqlen, 3, heads, head_dim) (q, k, v = qkv.unbind(-3)), or, for GQA / MQA,
    (batch, seqlen, num_heads_q + 2 * heads_kv, head_dim) with num_heads_q given (q, k, v = the
    first num_heads_q heads, the next heads_kv, the last heads_kv: a fused QKV projection's
    output). Every other argument as in flash_attn_func (FP8 qkv with its descales too). The
    gradient is one tensor shaped like qkv: in plain eager training the backward writes dq, dk
    and dv straight into its parts (no concatenation); traced (torch.compile), autograd
    assembles it from the views.
    """
    q, k, v = _split_qkv(qkv, num_heads_q)
    _check_flags(return_attn_probs, deterministic)
    if attention_chunk != 0 or sm_margin != 0:
        _validate.check_fa3_extras(attention_chunk, 1, None, sm_margin, chunk_served=True)
    if (qkv.dtype in TORCH_DTYPES and qkv.requires_grad and torch.is_grad_enabled()
            and _plain_eager(q, k, v) and not attention_chunk):
        out, lse = _autograd.QkvPackedFunction.apply(
            qkv, lambda t: _split_qkv(t, num_heads_q), softmax_scale, causal, window_size,
            softcap, backend, deterministic, sm_margin)
        return (out, lse) if return_attn_probs else out
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale,
                           window_size, attention_chunk, softcap, 1, None, deterministic,
                           sm_margin, return_attn_probs, backend=backend)


def _split_qkv(qkv: object, num_heads_q: object) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """flash_attn_qkvpacked_func's views q, k, v of ``qkv`` (checked: a clear error naming
    qkv / num_heads_q instead of FA3's asserts)."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv: expected a torch.Tensor, got {type(qkv).__name__}")
    if num_heads_q is not None and (isinstance(num_heads_q, bool)
                                    or not isinstance(num_heads_q, numbers.Integral)):
        raise TypeError(f"num_heads_q: expected None or an int, got {num_heads_q!r}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv: expected shape (batch, seqlen, 3, heads, head_dim), got "
                             f"{tuple(qkv.shape)}")
        if num_heads_q is not None and num_heads_q != qkv.shape[3]:
            raise ValueError(f"num_heads_q: expected None or qkv.shape[3] ({qkv.shape[3]}) for "
                             f"a 5-D qkv, got {num_heads_q}")
        q, k, v = qkv.unbind(dim=2)
        return q, k, v
    if qkv.dim() == 4:
        heads = qkv.shape[2]
        if num_heads_q is None:
            raise ValueError(f"num_heads_q: expected an int for a 4-D qkv (batch, seqlen, "
                             f"num_heads_q + 2 * heads_kv, head_dim), got None (qkv shape "
                             f"{tuple(qkv.shape)})")
        heads_kv2 = heads - num_heads_q
        if num_heads_q < 1 or heads_kv2 < 2 or heads_kv2 % 2:
            raise ValueError(f"num_heads_q: expected 1 <= num_heads_q and qkv.shape[2] - "
                             f"num_heads_q a positive even number (2 * heads_kv), got "
                             f"num_heads_q={num_heads_q} with qkv.shape[2]={heads}")
        q, k, v = qkv.split([num_heads_q, heads_kv2 // 2, heads_kv2 // 2], dim=2)
        return q, k, v
    raise ValueError(f"qkv: expected 5 dims (batch, seqlen, 3, heads, head_dim) or 4 (batch, "
                     f"seqlen, num_heads_q + 2 * heads_kv, head_dim), got shape "
                     f"{tuple(qkv.shape)}")


def _check_flags(return_attn_probs: object, deterministic: object) -> None:
    """FA3's two bool flags, exactly bools (1 / "yes" name the argument instead)."""
    if return_attn_probs is not True and return_attn_probs is not False:
        raise TypeError(f"return_attn_probs: expected a bool, got {return_attn_probs!r}")
    if deterministic is not True and deterministic is not False:
        raise TypeError(f"deterministic: expected a bool, got {deterministic!r}")


def _fp8_forward(q, k, v, softmax_scale, causal, window_size, softcap, backend, q_descale,
                 k_descale, v_descale, out_dtype, fp8_accumulation, return_attn_probs):
    """flash_attn_func for FP8 q / k / v (eager, no autograd)."""
    if return_attn_probs is not True and return_attn_probs is not False:
        raise TypeError(f"return_attn_probs: expected a bool, got {return_attn_probs!r}")
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _plain_eager(q, k, v):
        def run():
            return _fwd.fp8_eager(q, k, v, softmax_scale, causal, window_size, softcap, backend,
                                  q_descale, k_descale, v_descale, out_dtype, fp8_accumulation,
                                  need_lse=return_attn_probs)
        # Inputs that require grad: the forward runs, a backward through it raises (FA3's way)
        out, lse = _autograd.ForwardOnly.apply(run, q, k, v) if grad else run()
    elif grad:
        raise UnsupportedError(_autograd.FORWARD_ONLY)
    else:  # torch.compile / make_fx / FakeTensors: the custom op, validated here (metadata)
        cfg, fp8 = _validate.check_fp8_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                            backend, q_descale, k_descale, v_descale, out_dtype,
                                            fp8_accumulation)
        out, lse = ops.fwd_fp8(q, k, v, q_descale, k_descale, v_descale, cfg.softmax_scale,
                               cfg.window_left, cfg.window_right, cfg.softcap, cfg.backend,
                               fp8.out_dtype, fp8.two_level)
    return (out, lse) if return_attn_probs else out


def _fp8_call(q: object, k: object) -> bool:
    """Whether a call takes the FP8 forward: FP8 q (k and v validated to match), or fp16 / bf16 q
    with FP8 k (the mixed mode)."""
    q_dtype = getattr(q, "dtype", None)
    return q_dtype in FP8_DTYPES or (q_dtype in TORCH_DTYPES
                                     and getattr(k, "dtype", None) in KV_FP8_DTYPES)


def _plain_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when no tracer, tensor subclass or dispatch mode needs to see the ops.

    Spelled out without generators: it runs on every eager call.
    """
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return False
    tensor = torch.Tensor
    # FakeTensor, FunctionalTensor, other subclasses, or not a tensor at all (validation says so)
    return type(q) is tensor and type(k) is tensor and type(v) is tensor


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
    """(backend, reason) of the kernel family flash_attn_func would use for these arguments,
    without launching: the library's own policy on q's device. "fa2", "fa3" (or an FA-3 variant),
    "decode" for the short queries the decode kernel serves (backend "auto", FLASH_HOPPER_DECODE
    allowing the route), "none" when there is nothing to compute.

    Raises like flash_attn_func would (invalid arguments, no kernel for this GPU/build).
    """
    if _fp8_call(q, k):  # FP8 q, k, v or FP8 k, v (the mixed mode): the FP8 forward's policy
        plan = _fwd.plan_fp8(q, k, v, softmax_scale, causal, window_size, softcap, backend)
    elif _dv.differs(q, v):  # v's own head dim: its kernel, or the padded call's (_dv.py)
        return _dv.which_backend(q, k, v, backend, softmax_scale, causal, window_size, softcap)
    else:
        plan = _fwd.plan_eager(q, k, v, softmax_scale, causal, window_size, softcap, backend)
    return plan.backend, plan.reason
