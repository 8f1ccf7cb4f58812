"""FA3's attention_chunk (chunked-local attention, Llama 4's): query row i sees only the keys of
the chunk its diagonal column i + seqlen_k - seqlen_q falls in,

    floor((i + seqlen_k - seqlen_q) / chunk) == floor(j / chunk),

besides the causal / window rule (mask.py). Served without kernels of its own: the rows whose
diagonal falls in chunk c see only that chunk's keys, so each (batch, chunk) is an independent
attention over contiguous rows and keys, and each is bottom-right aligned with the same window:
its rows end where its keys end (the last row's diagonal is the chunk's last column, or the
sequence's last key), so the window's offsets, relative to the diagonal, carry over unchanged.
The pieces run as one varlen call on the dense tensors viewed as (batch * seqlen, heads, d),
with the offsets built here (no read-back); rows whose diagonal lies before column 0 (seqlen_q >
seqlen_k) form one piece without keys per batch entry (out 0, lse -inf, as any row that sees
nothing). Forward and backward (the varlen backward, per piece), eager and traced; FP8 (e4m3,
FA3's descales per (sequence, KV head)) forward, eagerly: each piece takes its sequence's
descales (piece_descales).
varlen_forward splits each sequence of a varlen call the same way (its offsets read back once,
eager); kvcache._chunked gathers a cache's attended keys and calls it.

Cost: a chunk shorter than the kernels' tiles leaves most of each tile's rows empty; Llama 4's
chunk (8192) is many tiles long.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _autograd, _validate, _varlen, ops
from ._errors import UnsupportedError


def restricts(chunk: int, seqlen_q: int, seqlen_k: int) -> bool:
    """Whether the chunk rule hides anything: every diagonal (i + seqlen_k - seqlen_q, from
    seqlen_k - seqlen_q to seqlen_k - 1) and every key in chunk 0 means it does not."""
    return chunk > 0 and (seqlen_k > chunk or seqlen_q > seqlen_k)


def pieces(batch: int, seqlen_q: int, seqlen_k: int,
           chunk: int) -> tuple[list[int], list[int], int, int, list[int]]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, owners) of the pieces of a dense
    call (split() of its batch entries, every piece used in full)."""
    spans = [(seqlen_q, seqlen_q, seqlen_k, seqlen_k)] * batch
    cu_q, cu_k, _, _, max_q, max_k, owners = split(spans, chunk)
    return cu_q, cu_k, max_q, max_k, owners


def split(spans: list[tuple[int, int, int, int]], chunk: int, row0: int = 0,
          key0: int = 0) -> tuple[list[int], list[int], list[int], list[int], int, int,
                                  list[int]]:
    """The pieces of consecutive sequences, each (rows, used rows, keys, used keys) from row0 /
    key0: (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
    owners), owners[p] the sequence piece p belongs to.

    Per sequence (diag = used keys - used rows): a piece without keys for the rows that see no
    chunk (diag < 0); one piece per chunk c, rows [max(0, c * chunk - diag), min(used rows,
    (c + 1) * chunk - diag)), keys [c * chunk, min(used keys, (c + 1) * chunk)); keys no row sees
    (before the first row's chunk) in a piece without rows, so that each piece's keys start where
    the previous piece's end; the unused rest of the sequence in a piece whose seqused are 0."""
    cu_q, cu_k, used_q, used_k, owners = [row0], [key0], [], [], []
    max_q = max_k = 0

    def piece(rows_end: int, keys_end: int, used: bool = True) -> None:
        nonlocal max_q, max_k
        rows, keys = rows_end - cu_q[-1], keys_end - cu_k[-1]
        max_q, max_k = max(max_q, rows), max(max_k, keys)
        cu_q.append(rows_end)
        cu_k.append(keys_end)
        used_q.append(rows if used else 0)
        used_k.append(keys if used else 0)
        owners.append(owner)

    for owner, (rows, seqlen_q, keys, seqlen_k) in enumerate(spans):
        q0, k0 = cu_q[-1], cu_k[-1]
        diag = seqlen_k - seqlen_q
        blind = seqlen_q if seqlen_k == 0 else min(max(-diag, 0), seqlen_q)
        if blind:  # rows whose diagonal lies before column 0
            piece(q0 + blind, k0)
        last = (seqlen_k - 1) // chunk if seqlen_k > 0 else -1
        for c in range(max(diag, 0) // chunk, last + 1):
            if cu_k[-1] < k0 + c * chunk:  # keys no row sees: a piece without rows
                piece(cu_q[-1], k0 + c * chunk)
            piece(q0 + min(seqlen_q, (c + 1) * chunk - diag), k0 + min(seqlen_k, (c + 1) * chunk))
        if cu_k[-1] < k0 + seqlen_k:  # used keys after the last row's chunk: none here, but
            piece(cu_q[-1], k0 + seqlen_k)  # keep the offsets on this sequence's keys
        if cu_q[-1] < q0 + rows or cu_k[-1] < k0 + keys:  # the unused rest
            piece(q0 + rows, k0 + keys, used=False)
    return cu_q, cu_k, used_q, used_k, max_q, max_k, owners


def piece_descales(descales: tuple, owners: list[int], batch: int, heads_kv: int,
                   device: torch.device) -> tuple:
    """An FP8 call's (q, k, v) descales for its pieces: each checked against the call's
    sequences first (fp32 (batch, heads_kv), or 0-d / (1,) for all), then a (batch, heads_kv)
    one gathered to (pieces, heads_kv), piece p taking its sequence owners[p]'s row; 0-d / (1,)
    ones and None as they are."""
    index = None
    result = []
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
        _validate._check_descale(name, t, batch, heads_kv)
        if t is not None and _validate._shape(t) not in ((), (1,)):
            if index is None:
                index = torch.tensor(owners, dtype=torch.long, device=device)
            t = t.index_select(0, index)
        result.append(t)
    return tuple(result)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, softmax_scale: Any,
            causal: Any, window_size: Any, softcap: Any, backend: Any, deterministic: bool,
            sm_margin: int, return_attn_probs: bool, plain_eager: bool,
            descales: tuple | None = None):
    """flash_attn_func with attention_chunk > 0 on fp16 / bf16 tensors, or e4m3 ones with
    ``descales`` (q, k, v; eager, forward only), validated here first with flash_attn_func's
    messages; None when the chunk hides nothing (the caller runs the plain call)."""
    if descales is not None:
        cfg, _ = _validate.check_fp8_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                          backend, *descales, None, "two-level")
    else:
        cfg = _validate.check_fwd_args(q, k, v, softmax_scale, causal, window_size, softcap,
                                       backend)
    b, sq, sk = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    if not restricts(chunk, sq, sk):
        return None  # the plain call is the same
    cu_q, cu_k, max_q, max_k, owners = pieces(b, sq, sk, chunk)
    # Pieces are written in full (rows of a piece without keys get 0 / -inf), so every row is.
    cu_seqlens_q = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
    cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    qf, kf, vf = (t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]) for t in (q, k, v))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if descales is not None:
        out, lse = _fp8_run(qf, kf, vf, cu_seqlens_q, cu_seqlens_k, None, None, max_q, max_k,
                            cfg, sm_margin, return_attn_probs, plain_eager, grad, None,
                            piece_descales(descales, owners, b, cfg.heads_kv, q.device), chunk)
    else:
        out, lse = _run(qf, kf, vf, cu_seqlens_q, cu_seqlens_k, None, None, max_q, max_k, cfg,
                        deterministic, sm_margin, return_attn_probs, plain_eager, grad)
    out = out.view(b, sq, cfg.heads_q, out.shape[-1])
    if not return_attn_probs:
        return out
    return out, lse.view(cfg.heads_q, b, sq).transpose(0, 1).contiguous()


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any,
                   cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, seqused_q: Any,
                   seqused_k: Any, chunk: int, softmax_scale: Any, causal: Any, window_size: Any,
                   softcap: Any, backend: Any, deterministic: bool, sm_margin: int,
                   out: torch.Tensor | None, grad: bool, descales: tuple | None = None):
    """flash_attn_varlen_func with attention_chunk > 0 (fp16 / bf16, or e4m3 with ``descales``
    forward only; eager): the offsets are read back once (after the usual checks) and every
    sequence split like a dense call; (out, lse)."""
    vc = _varlen.check_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_q, seqused_k, softmax_scale, causal, window_size, softcap,
                            backend, *(descales or (None, None, None)))
    cfg = vc.cfg
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise UnsupportedError(f"attention_chunk: expected 0 while a CUDA graph is captured "
                               f"(varlen chunks are split on the host from the offsets), got "
                               f"{chunk}")
    if _varlen.offsets_checked():  # one read of the offsets, checked
        h = _varlen.check_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, q.shape[0],
                                  k.shape[0])
    else:
        h = _varlen.host_offsets(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    spans = []
    for b in range(len(h.cu_q) - 1):
        rows, keys = h.cu_q[b + 1] - h.cu_q[b], h.cu_k[b + 1] - h.cu_k[b]
        spans.append((rows, h.used_q[b] if h.used_q is not None else rows,
                      keys, h.used_k[b] if h.used_k is not None else keys))
    cu_q, cu_k, used_q, used_k, max_q, max_k, owners = split(spans, chunk, h.cu_q[0],
                                                             h.cu_k[0])
    device = q.device
    cu_q, cu_k, used_q, used_k = (torch.tensor(x, dtype=torch.int32, device=device)
                                  for x in (cu_q, cu_k, used_q, used_k))
    if descales is not None:
        return _fp8_run(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, cfg, sm_margin, True,
                        True, grad, out, piece_descales(descales, owners, len(spans),
                                                        cfg.heads_kv, device), chunk)
    return _run(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, cfg, deterministic,
                sm_margin, True, True, grad, out)


def _fp8_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
             cu_k: torch.Tensor, used_q: torch.Tensor | None, used_k: torch.Tensor | None,
             max_q: int, max_k: int, cfg: Any, sm_margin: int, need_lse: bool,
             plain_eager: bool, grad: bool, out: torch.Tensor | None, descales: tuple,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The FP8 varlen call over the pieces (forward only, eagerly; inputs that require grad run
    the forward and a backward through it raises, as every FP8 call's)."""
    if not plain_eager:
        raise UnsupportedError(f"attention_chunk: expected 0 with FP8 inputs under torch.compile "
                               f"/ tracing (chunked FP8 attention runs eagerly), got {chunk}")
    window = (cfg.window_left, cfg.window_right)

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        result, lse, _ = _varlen.forward(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k,
                                         cfg.softmax_scale, False, window, cfg.softcap,
                                         cfg.backend, out=out, need_lse=need_lse,
                                         descales=descales, checked=True, sm_margin=sm_margin)
        return result, lse

    return _autograd.ForwardOnly.apply(run, q, k, v) if grad else run()


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
         cu_k: torch.Tensor, used_q: torch.Tensor | None, used_k: torch.Tensor | None,
         max_q: int, max_k: int, cfg: _validate.FwdConfig, deterministic: bool, sm_margin: int,
         need_lse: bool, plain_eager: bool, grad: bool,
         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One varlen call over the pieces (the mask's causal already folded into cfg's window), by
    flash_attn_varlen_func's routes: eager with the offsets taken as built (no read-back),
    through autograd when an input requires grad, or the custom op when traced."""
    window = (cfg.window_left, cfg.window_right)
    if plain_eager and not grad:
        result, lse, _ = _varlen.forward(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k,
                                         cfg.softmax_scale, False, window, cfg.softcap,
                                         cfg.backend, out=out, need_lse=need_lse, checked=True,
                                         sm_margin=sm_margin)
        return result, lse
    if plain_eager:
        return _autograd.FlashAttnVarlenFunction.apply(
            q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k, cfg.softmax_scale, False, window,
            cfg.softcap, cfg.backend, deterministic, sm_margin, True)
    vcfg = _varlen.check_args(q, k, v, cu_q, cu_k, max_q, max_k, used_q, used_k,
                              cfg.softmax_scale, False, window, cfg.softcap, cfg.backend).cfg
    return ops.fwd_varlen(q, k, v, cu_q, cu_k, used_q, used_k, max_q, max_k, vcfg.softmax_scale,
                          vcfg.window_left, vcfg.window_right, vcfg.softcap, vcfg.backend,
                          deterministic, sm_margin)
