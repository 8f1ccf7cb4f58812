"""flash-hopper as a Hugging Face transformers attention backend (docs/integrations.md).

    from flash_hopper.integrations.transformers import register
    name = register()  # once: "fh_attention"; then
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

``register`` adds ``attention_forward`` to transformers' AttentionInterface and, where transformers
has one (>= 4.53), ``key_mask`` to its AttentionMaskInterface under the same name, so the model
builds the mask this backend reads instead of a dense 4-D one. transformers is imported only by
``register``: this module imports without it.

The name has no "flash" in it: transformers 5 takes every attn_implementation containing "flash"
for a FlashAttention package or hub kernel and loads one at model construction, which fails for
a function registered through AttentionInterface. register() refuses such a name there.

The mapping, per call (transformers' own flash-attention integration is the model for it):

- q / k / v arrive (batch, heads, seq, head_dim) and go in as (batch, seq, heads, head_dim); GQA
  passes through (k / v keep their fewer heads). The output is (batch, seq, heads, head_dim).
- ``scaling`` -> softmax_scale; ``softcap`` (Gemma-2's attn_logit_softcapping) -> softcap;
  ``sliding_window`` w (or ``module.sliding_window``) -> window_size (w - 1, 0) when causal, a
  query seeing itself and the w - 1 keys before it, as transformers' masks define the window;
  causal from the ``is_causal`` keyword, else ``module.is_causal``.
- a key mask (batch, keys) True where a key takes part (``key_mask``'s, or a 2-D padding mask,
  or reduced from a 4-D mask: a key any query sees) -> flash_attn_varlen_func on the unpadded
  tokens, the output scattered back (padded query rows are 0). Keys past the mask's length (a
  static cache's unfilled slots) are dropped. Queries are the mask's last seq_q positions, or
  every row for a one-token step.
- no mask, with ``cu_seq_lens_q / _k`` and ``max_length_q / _k`` or packed ``position_ids``
  (batch 1, several sequences restarting at 0): flash_attn_varlen_func over the packed
  sequences (transformers' padding-free path).
- otherwise flash_attn_func on the dense tensors.

Attention sinks (gpt-oss's ``s_aux``, one logit per query head in the model's dtype) go to the
functions' ``sinks`` in fp32. Refused, with the reason: dropout > 0 (the kernels have none: train
with attention_dropout=0).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import interface

NAME = "fh_attention"
# The name under transformers 4.x before 5 reserved "flash" names; registered there as well.
LEGACY_NAME = "flash_hopper"
MIN_VERSION = "4.48"  # the first transformers with AttentionInterface
# transformers >= 5 treats an attn_implementation containing this as FlashAttention (a package or
# a hub kernel to load); 4.x reserved only the "flash_attention_N" names.
FLASH_MARKER = "flash"


def _transformers() -> Any:
    """The transformers module, or an ImportError that names the package and the extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"flash_hopper.integrations.transformers needs the transformers package (>= "
            f"{MIN_VERSION}): pip install 'flash-hopper[transformers]'") from exc
    if not hasattr(transformers, "AttentionInterface"):
        raise ImportError(f"flash_hopper.integrations.transformers needs transformers >= "
                          f"{MIN_VERSION} (AttentionInterface), found {transformers.__version__}")
    return transformers


def register(name: str = NAME) -> str:
    """Registers flash-hopper's attention (and its mask, where transformers has a mask interface)
    under ``name``; returns it, for ``attn_implementation=register()``."""
    transformers = _transformers()
    major = int(transformers.__version__.split(".")[0])
    if major >= 5 and FLASH_MARKER in name:
        raise ValueError(f"name: transformers {transformers.__version__} loads an "
                         f"attn_implementation containing {FLASH_MARKER!r} as a FlashAttention "
                         f"package or hub kernel, not through AttentionInterface; expected a name "
                         f"without it (the default is {NAME!r}), got {name!r}")
    names = [name]
    if major < 5 and name == NAME:
        names.append(LEGACY_NAME)  # 4.x takes it too: attn_implementation="flash_hopper"
    for n in names:
        transformers.AttentionInterface.register(n, attention_forward)
        if hasattr(transformers, "AttentionMaskInterface"):
            transformers.AttentionMaskInterface.register(n, key_mask)
    return name


def key_mask(batch_size: int, cache_position: torch.Tensor | None = None,
             kv_length: int | None = None, kv_offset: int = 0,
             attention_mask: torch.Tensor | None = None, *, q_length: int | None = None,
             q_offset: int | torch.Tensor = 0, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask hook: (batch, keys) bool, True where one of the keys the layer attends
    to is a token (not padding), or None when every key is. Keys cover positions kv_offset ..
    kv_offset + kv_length - 1; those past the last query (a static cache's unfilled slots) are
    left out of the mask, so attention_forward drops them. The causal and window patterns are
    the kernel's (causal / window_size), not the mask's: mask_function is not read.

    The queries' positions come as transformers passes them: 4.x ``cache_position`` (the
    positions themselves), 5.x ``q_offset`` and ``q_length`` (the first one and how many; the
    offset a tensor for a static cache). Both name them by keyword."""
    if kv_length is None:
        raise TypeError("key_mask: kv_length is required (transformers passes it by keyword)")
    if cache_position is not None:
        query_end = int(cache_position[-1]) + 1
        device = cache_position.device
    elif q_length is not None:
        query_end = int(q_offset) + q_length
        device = kwargs.get("device")  # 5.x passes it; else the offset's or the mask's
        if device is None:
            source = q_offset if isinstance(q_offset, torch.Tensor) else attention_mask
            device = source.device if source is not None else "cpu"
    else:
        raise TypeError("key_mask: expected the queries' positions as cache_position "
                        "(transformers 4.x) or q_length and q_offset (5.x), got neither")
    filled = min(kv_length, query_end - kv_offset)
    if attention_mask is None:
        if filled == kv_length:
            return None
        return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
    positions = torch.arange(kv_offset, kv_offset + filled, device=device)
    padding = attention_mask.to(device=device, dtype=torch.bool)
    short = kv_offset + filled - padding.shape[-1]
    if short > 0:  # a mask shorter than the keys: the keys past it are not tokens yet
        padding = torch.nn.functional.pad(padding, (0, short), value=False)
    mask = padding[:, positions]
    return None if filled == kv_length and bool(mask.all()) else mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention hook: query (batch, heads_q, seq_q, d), key / value (batch,
    heads_kv, seq_k, d) -> ((batch, seq_q, heads_q, d), None); the module docstring has the
    mapping."""
    if dropout:
        raise ValueError(f"dropout: flash-hopper's kernels have no attention dropout; expected 0.0 "
                         f"(model.eval(), or attention_dropout=0 to train), got {dropout}")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    if sliding_window is None:
        sliding_window = getattr(module, "sliding_window", None)
    window = (-1, -1)
    if sliding_window:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    options = {"softmax_scale": scaling, "causal": causal, "window_size": window,
               "softcap": float(softcap or 0.0)}
    if kwargs.get("s_aux") is not None:  # gpt-oss's sinks, a parameter in the model's dtype
        options["sinks"] = kwargs["s_aux"].float()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seq, heads, d)
    if attention_mask is not None:
        return _padded(q, k, v, _keys_taking_part(attention_mask), options), None
    packed = _packed_lengths(q, kwargs)
    if packed is not None:
        (cu_q, cu_k), (max_q, max_k) = packed
        flat = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
        out = interface.flash_attn_varlen_func(*flat, cu_q, cu_k, max_q, max_k, **options)
        return out.view(q.shape[0], -1, *out.shape[1:]), None
    return interface.flash_attn_func(q, k, v, **options), None


def _keys_taking_part(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, keys) bool from key_mask's or a 2-D padding mask (nonzero = a token), or from a
    4-D (batch, 1, seq_q, keys) mask, bool (True = visible) or additive (0 = visible): a key any
    query sees. Keys no query sees lie outside every query's window, so leaving them out
    changes no output."""
    if attention_mask.dim() == 2:
        return attention_mask.bool()
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask: expected a (batch, keys) or (batch, 1, seq_q, keys) "
                         f"mask, got shape {tuple(attention_mask.shape)}")
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return visible.any(dim=2).any(dim=1)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
            options: dict[str, Any]) -> torch.Tensor:
    """Attention of a padded batch through flash_attn_varlen_func: the tokens of each sequence
    packed, the output scattered back to (batch, seq_q, heads, d) with zeros on padded rows."""
    batch, seq_q = q.shape[:2]
    k, v = k[:, :keys.shape[1]], v[:, :keys.shape[1]]  # a static cache's unfilled tail
    if seq_q == keys.shape[1]:
        queries = keys
    elif seq_q == 1:  # a decode step: its one query is the newest token of every sequence
        queries = torch.ones(batch, 1, dtype=torch.bool, device=q.device)
    else:  # the newest seq_q keys are the queries (left padding, as generate pads)
        queries = keys[:, -seq_q:]
    rows_q, cu_q, max_q = _unpad_index(queries)
    rows_k, cu_k, max_k = _unpad_index(keys)
    packed_q = q.reshape(-1, *q.shape[2:])[rows_q]
    packed_k, packed_v = (t.reshape(-1, *t.shape[2:])[rows_k] for t in (k, v))
    out = interface.flash_attn_varlen_func(packed_q, packed_k, packed_v, cu_q, cu_k, max_q,
                                           max_k, **options)
    full = out.new_zeros(batch * seq_q, *out.shape[1:])
    full[rows_q] = out
    return full.view(batch, seq_q, *out.shape[1:])


def _unpad_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(rows of the flattened batch that take part, int32 cu_seqlens, the longest sequence)."""
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return mask.flatten().nonzero().flatten(), cu, int(lengths.max())


def _packed_lengths(q: torch.Tensor, kwargs: dict[str, Any]) -> tuple | None:
    """((cu_q, cu_k), (max_q, max_k)) of a padding-free batch, from transformers' cu_seq_lens_q /
    _k and max_length_q / _k keywords or from packed position_ids (batch 1, positions restarting
    at 0 per sequence); None for an ordinary batch."""
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                     "max_length_k")]
    if all(x is not None for x in given):
        return (given[0].to(torch.int32), given[1].to(torch.int32)), (int(given[2]),
                                                                      int(given[3]))
    positions = kwargs.get("position_ids")
    if positions is None or q.shape[0] != 1 or positions.shape[-1] != q.shape[1]:
        return None
    positions = positions.reshape(-1)
    starts = (positions == 0).nonzero().flatten()
    if len(starts) < 2 or int(starts[0]) != 0:  # one sequence (or a chunk of one): dense
        return None
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return (cu, cu), (longest, longest)
