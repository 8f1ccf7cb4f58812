"""FP8 (e4m3) and mixed-mode benchmark inputs: how a case's q, k, v are made, what backends
receive, and how the reference check undoes the quantization.

Made: the runner draws q, k, v exactly as for the bf16 case of the same seed (same shapes,
N(0, 1), same generator calls), then quantizes each with flash_hopper.fp8.quantize per head; q
with heads_kv = k's heads, since FA3 (and flash-hopper, which follows it) takes one q descale per
kv head. So an e4m3 row and the bf16 row of the same configuration time the same values, up to
the rounding to FP8.

Received: one ``Fp8Input`` per tensor, the float8_e4m3fn data and its fp32 (batch, heads_kv)
descale: the pair FA3's and flash-hopper's flash_attn_func take (``q_descale=`` ...). A backend
says whether it takes them (base.Backend.fp8_reason); the runner skips the others.

Undone: ``dequantize`` gives the real values the kernel multiplies (data * descale, per kv head,
repeated over the query heads that share it). The reference is exact attention on those, so the
check measures the kernel's own FP8 error (P rounded to e4m3 for P V), not the quantization of the
inputs, which every FP8 implementation shares.

Mixed mode ("bf16+e4m3", ...: 16-bit q against an FP8 K / V cache): q, k, v are drawn as for the
case of q's dtype with the same seed; q stays as it is, and k and v are quantized per (batch, kv
head) into the FP8 dtype (``quantize_kv_cache``), as a KV cache that stores one scale per head
would hold them. Backends receive q as a tensor and k, v as Fp8Inputs, passed as flash_attn_func(q,
k.data, v.data, k_descale=k.descale, v_descale=v.descale); the reference is fp32 attention of q on
the dequantized k and v, by the 16-bit rule (check.MixedReferences), since the kernel converts K / V
exactly to q's dtype and its GEMMs are 16-bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fp8Input:
    """One FP8 input: ``data`` (torch.float8_e4m3fn, or float8_e5m2 for a mixed case's k / v;
    (batch, seqlen, heads, head_dim)) and ``descale`` (float32 (batch, heads_kv)), with
    data.float() * descale ~ the original values."""

    data: Any
    descale: Any

    def dequantize(self, dtype: Any = None):
        return dequantize(self.data, self.descale, dtype)


def quantize_inputs(q, k, v) -> tuple[Fp8Input, Fp8Input, Fp8Input]:
    """q, k, v (batch, seqlen, heads, head_dim), fp32 / fp16 / bf16 -> their Fp8Inputs, quantized
    per (batch, head) by flash_hopper.fp8.quantize; q per kv head."""
    from flash_hopper import fp8

    heads_kv = k.shape[2]
    q8 = Fp8Input(*fp8.quantize(q, "head", heads_kv=heads_kv))
    k8 = Fp8Input(*fp8.quantize(k, "head"))
    v8 = Fp8Input(*fp8.quantize(v, "head"))
    return q8, k8, v8


def quantize_kv_cache(k, v, dtype: Any = "e4m3") -> tuple[Fp8Input, Fp8Input]:
    """k, v (batch, seqlen_k, heads_kv, head_dim), fp32 / fp16 / bf16 -> their Fp8Inputs in the FP8
    ``dtype`` ("e4m3" or "e5m2", or torch's float8_e4m3fn / float8_e5m2), each quantized per
    (batch, kv head) by flash_hopper.fp8.quantize (amax-calibrated to the dtype's largest value:
    448 for e4m3, 57344 for e5m2): a mixed case's K / V cache."""
    from flash_hopper import _tables, fp8

    torch_dtype = _tables.kv_fp8_dtype(dtype)
    k8 = Fp8Input(*fp8.quantize(k, "head", torch_dtype))
    v8 = Fp8Input(*fp8.quantize(v, "head", torch_dtype))
    return k8, v8


def dequantize(data, descale, dtype: Any = None):
    """data (batch, seqlen, heads, head_dim) in ``dtype`` (default float32) times its descale:
    (batch, groups) with heads % groups == 0, each entry scaling heads // groups consecutive heads
    (a kv head's query heads, for q), 0-d / (1,) for one factor, or None for 1.0 (as
    flash_attn_func takes them)."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    x = data.to(dtype)
    if descale is None:
        return x
    scale = descale.to(device=x.device, dtype=dtype)
    if scale.dim() == 0 or scale.numel() == 1:
        return x * scale.reshape(())
    batch, _, heads, _ = x.shape
    if scale.dim() != 2 or scale.shape[0] != batch or heads % scale.shape[1]:
        raise ValueError(f"descale: expected shape (batch, groups) = ({batch}, a divisor of "
                         f"{heads}), a 0-d tensor or shape (1,), got {tuple(scale.shape)}")
    per_head = scale.repeat_interleave(heads // scale.shape[1], dim=1)  # (batch, heads)
    return x * per_head[:, None, :, None]
