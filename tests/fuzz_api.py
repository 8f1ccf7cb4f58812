"""Random calls of the public API, valid and invalid, each judged on its own.

Valid calls (a GPU and the kernel library): flash_attn_func, flash_attn_qkvpacked_func (with
FA3's attention_chunk too), flash_attn_varlen_func (forward, and backward where the build has
the kernels) and
flash_attn_with_kvcache (a dense cache, appended keys, a permuted batch index), with random
shapes (1..~1100 tokens, zero-length sequences in varlen), GQA ratios, head dims (any multiple of
8 up to the largest built bucket), masks, softcap, scale, strided layouts. Each result is judged
by FA3's rule against the float reference: max|x - ref| <= f * max|x_lowp - ref| + atol, where
x_lowp is the same reference computed in the input dtype (f = 2, 3 with softcap for gradients),
atol FA3's rounding scale of the reference; rows that see no key must be exactly 0 (out) and
-inf (lse), their dq too; NaN anywhere fails.

Invalid calls (FakeTensors on a "cuda" device, or real CUDA tensors): one argument
of a valid flash_attn_func / qkvpacked / varlen call broken at a time (dtype, rank, sizes,
strides, devices, masks, scalars); the call must raise TypeError, ValueError or
NotImplementedError whose message names the argument, and on a GPU the CUDA context must stay
healthy after it (nothing launched with the bad input). And a type fuzz (type_fuzz): every
parameter of every entry point given None, a str, a float, a bool, a negative or a 2**70 int,
a list, a tuple, an object, NaN: it runs, or raises one of those naming the parameter.

Serving hazards (hazard_case, kind "hazard", in the default rotation): flash_attn_func,
flash_attn_varlen_func and flash_attn_with_kvcache (dense and paged caches) with adversarial
values -- offsets decreasing, negative, past the tokens or 2**31 - 1, seqused_k out of its span,
a short max_seqlen_q, cache indices, left pads, lengths and page-table entries out of range,
duplicated indices, expanded / strided / transposed index tensors and page tables, windows of
2**31 - 1, 2**32, 2**40 -- with the library's value checks on and off
(FLASH_HOPPER_CHECK_OFFSETS=0). out= is a slice of a sentinel-filled buffer, the inputs and
caches slices of NaN-filled ones: nothing outside out and the caches may change, a refusal names
an argument and changes no cache, a result holds no NaN, values within the contract give the
reference's result, and the device must still synchronize (a fault stops the run).

    python tests/fuzz_api.py --seconds 120 --seed 1 --out fuzz.json [--invalid-only] [--small]
    python tests/fuzz_api.py --seconds 120 --seed 1 --kinds hazard

tests/test_fuzz.py runs a fixed-seed slice of both on CPU (invalid) and GPU (valid, hazards),
and the hazard draws and checkers on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, "") and str(Path(__file__).resolve().parents[1] / "python") not in \
        sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import flash_hopper
from flash_hopper import reference

ALLOWED = (TypeError, ValueError, NotImplementedError)
ULP_FLOOR = 1.0  # FH_FUZZ_ULP_FLOOR=0 for FA3's rule alone


# --- what the build can run ----------------------------------------------------------------------


@dataclass
class Capability:
    """What the loaded library runs on this GPU: (dtype, head-dim bucket) pairs with a forward,
    and those with a backward."""

    dtypes: list[torch.dtype]
    table: list[int]  # every head-dim bucket of the library's table
    buckets: list[int]  # those with a forward here
    fwd: set[tuple[torch.dtype, int]] = field(default_factory=set)
    bwd: set[tuple[torch.dtype, int]] = field(default_factory=set)

    @staticmethod
    def detect() -> Capability:
        info = flash_hopper.build_info()
        names = {"bf16": torch.bfloat16, "fp16": torch.float16}
        cc = torch.cuda.get_device_capability()
        fwd, bwd = set(), set()
        for kernel in info["kernels"]:
            dtype = names.get(kernel["dtype"])
            if dtype is None:
                continue
            runs_here = kernel["backend"] == "fa2" or cc == (9, 0)
            if runs_here and kernel.get("direction", "fwd") == "fwd":
                fwd.add((dtype, kernel["head_dim"]))
            if runs_here and kernel.get("direction") == "bwd":
                bwd.add((dtype, kernel["head_dim"]))
        if not fwd:
            raise SystemExit("fuzz_api: the library has no fp16 / bf16 forward for this GPU")
        return Capability(dtypes=sorted({t for t, _ in fwd}, key=str),
                          table=list(info["head_dim_buckets"]),
                          buckets=sorted({d for _, d in fwd}), fwd=fwd,
                          bwd={(t, d) for t, d in bwd if (t, d) in fwd})

    def bucket(self, head_dim: int) -> int:
        """The table's bucket of head_dim (what the library dispatches on)."""
        return next(b for b in self.table if b >= head_dim)

    def draw_head_dim(self, rng: random.Random, dtype: torch.dtype) -> int:
        """A multiple of 8 in a random bucket that has a forward for dtype."""
        bucket = rng.choice([b for b in self.buckets if (dtype, b) in self.fwd])
        below = max([b for b in self.table if b < bucket], default=0)
        return 8 * rng.randint(below // 8 + 1, bucket // 8)

    def has_bwd(self, dtype: torch.dtype, head_dim: int) -> bool:
        return (dtype, self.bucket(head_dim)) in self.bwd


# --- random draws --------------------------------------------------------------------------------


def draw_len(rng: random.Random, small: bool) -> int:
    r = rng.random()
    if r < 0.25:
        return rng.randint(1, 9)
    if r < 0.7 or small:
        return rng.randint(10, 200)
    return rng.randint(200, 1100)


def draw_heads(rng: random.Random) -> tuple[int, int]:
    heads_kv = rng.choice([1, 1, 2, 3, 4])
    return heads_kv * rng.choice([1, 1, 2, 3, 4]), heads_kv


def draw_mask(rng: random.Random, sq: int, sk: int) -> dict[str, Any]:
    mask: dict[str, Any] = {}
    if rng.random() < 0.4:
        mask["causal"] = True
    if rng.random() < 0.3:
        left = -1 if rng.random() < 0.3 else rng.randint(0, max(sk, 1))
        right = -1 if rng.random() < 0.3 else rng.randint(0, max(sq, 1))
        mask["window_size"] = (left, right)
    if rng.random() < 0.2:
        mask["softcap"] = round(rng.uniform(2.0, 50.0), 2)
    if rng.random() < 0.2:
        mask["softmax_scale"] = round(rng.uniform(0.02, 0.3), 4)
    return mask


def randn(shape, dtype, layout: str, rng: random.Random) -> torch.Tensor:
    """A (b, s, h, d) or (total, h, d) tensor, contiguous or strided (heads first in memory, or
    a slice of a wider last-but-one axis)."""
    if layout == "heads_first" and len(shape) == 4:
        b, s, h, d = shape
        return torch.randn(b, h, s, d, dtype=dtype, device="cuda").transpose(1, 2)
    if layout == "sliced":
        extra = rng.randint(1, 3)
        wide = torch.randn(*shape[:-2], shape[-2] + extra, shape[-1], dtype=dtype, device="cuda")
        return wide[..., extra:, :]
    return torch.randn(*shape, dtype=dtype, device="cuda")


# --- judging -------------------------------------------------------------------------------------


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def fa3_check(name: str, got: torch.Tensor, ref: torch.Tensor, lowp: torch.Tensor,
              factor: float, algorithm_ref: torch.Tensor | None = None) -> str | None:
    """FA3's rule for one result (None: passes), with NaN / shape / dtype checks first.

    algorithm_ref: for gradients, the exact float64 result of FlashAttention's backward itself,
    whose D = rowsum(dO * O) reads the stored, rounded O (FA2 / FA3 / ours alike). Where a row's
    softmax is nearly one-hot, dP - D cancels and that rounding alone moves dS by far more than
    the naive low-precision reference errs on a tiny problem; a result within the rule of either
    reference passes."""
    if got.shape != ref.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    if got.isnan().any():
        return f"{name}: NaN"
    if algorithm_ref is not None and fa3_check(name, got, algorithm_ref, lowp, factor) is None:
        return None
    ref_lowp = ref.to(got.dtype)
    atol = max(2 * max_err(ref_lowp + 0.3 - 0.3, ref_lowp), 1e-5)
    # Tiny problems (a few rows of a few keys) can leave the low-precision reference exact by
    # chance; one unit in the last place of the largest value (what the final rounding of an
    # fp32 result, with the bf16 / fp16 operands the algorithm rounds, costs) is the floor.
    largest = ref.abs().max().item() if ref.numel() else 0.0
    ulp = torch.finfo(got.dtype).eps * 2.0 ** math.floor(math.log2(largest)) if largest else 0.0
    lowp_err = max_err(lowp, ref)
    err, tol = max_err(got, ref), factor * lowp_err + max(atol, ULP_FLOOR * ulp)
    if err <= tol:
        return None
    return (f"{name}: max error {err:.4g} > tolerance {tol:.4g} (low-precision reference "
            f"{lowp_err:.4g}, atol {atol:.3g}, max |ref| {largest:.4g}, ulp {ulp:.3g})")


def lse_check(got: torch.Tensor, ref: torch.Tensor) -> str | None:
    """-inf exactly where the reference has -inf (rows that see no key), else close."""
    if got.shape != ref.shape:
        return f"lse: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    empty = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(got), empty):
        return "lse: -inf rows differ from the reference's (rows that see no key)"
    if got.isnan().any():
        return "lse: NaN"
    seen = ~empty
    err = max_err(got[seen].float(), ref[seen].float())
    scale = ref[seen].abs().max().item() if seen.any() else 0.0
    return None if err <= 1e-3 * max(scale, 1.0) + 1e-3 else f"lse: max error {err:.4g}"


def zero_rows_check(out: torch.Tensor, lse_ref: torch.Tensor) -> str | None:
    """out (b, s, h, d) [or (t, h, d) with lse (h, t)] is exactly 0 on rows that see no key."""
    empty = torch.isneginf(lse_ref)  # (b, h, s) or (h, t)
    rows = empty.transpose(-1, -2)  # (b, s, h) or (t, h)
    if rows.any() and (out[rows] != 0).any():
        return "out: a row that sees no key is not exactly 0"
    return None


def judge(results: dict[str, torch.Tensor], refs: dict[str, torch.Tensor],
          lowps: dict[str, torch.Tensor], softcap: float,
          algorithm_refs: dict[str, torch.Tensor] | None = None) -> list[str]:
    problems = []
    for name, got in results.items():
        if name == "lse":
            problem = lse_check(got, refs[name])
        else:
            factor = 3.0 if softcap and name.startswith("d") else 2.0
            problem = fa3_check(name, got, refs[name], lowps[name], factor,
                                (algorithm_refs or {}).get(name))
        if problem:
            problems.append(problem)
    if "out" in results and "lse" in refs:
        problem = zero_rows_check(results["out"], refs["lse"])
        if problem:
            problems.append(problem)
    return problems


def reference_and_grads(fn, inputs: list[torch.Tensor], dout: torch.Tensor | None,
                        upcast: bool) -> dict[str, torch.Tensor]:
    """fn(*leaves) -> (out, lse) of the reference, in float64 (upcast) or the input dtype, with
    (dq, dk, dv) when dout is given."""
    dtype = torch.float64 if upcast else inputs[0].dtype
    leaves = [t.detach().to(dtype).requires_grad_(dout is not None) for t in inputs]
    with torch.enable_grad() if dout is not None else torch.no_grad():
        out, lse = fn(leaves, upcast)
        result = {"out": out.detach(), "lse": lse.detach()}
        if dout is not None:
            grads = (torch.autograd.grad(out, leaves, dout.to(out.dtype), allow_unused=True)
                     if out.requires_grad else (None, None, None))
            for name, g, t in zip(("dq", "dk", "dv"), grads, leaves):
                result[name] = torch.zeros_like(t) if g is None else g
    return result


def algorithm_grads(inputs: list[torch.Tensor], refs: dict[str, torch.Tensor],
                    dout: torch.Tensor | None, mask: dict[str, Any],
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """(dq, dk, dv) of FlashAttention's backward in float64 from the float64 forward, with D
    from the output rounded to the input dtype (what the kernels store and read back)."""
    if dout is None:
        return {}
    q, k, v = (t.detach().double() for t in inputs)
    out = refs["out"].to(dtype).double()
    grads = reference.attention_bwd_ref(q, k, v, out, refs["lse"].double(), dout.double(),
                                        **mask)
    return dict(zip(("dq", "dk", "dv"), grads))


# --- valid cases ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    config: dict[str, Any]
    problems: list[str]
    seconds: float
    fatal: bool = False  # a device fault: the CUDA context is gone, the run stops


def _flash_results(call, inputs, dout, want_lse: bool) -> dict[str, torch.Tensor]:
    leaves = [t.detach().requires_grad_(dout is not None) for t in inputs]
    with torch.enable_grad() if dout is not None else torch.no_grad():
        out, lse = call(leaves)
        result = {"out": out.detach()}
        if want_lse:
            result["lse"] = lse.detach()
        if dout is not None:
            for name, g in zip(("dq", "dk", "dv"), torch.autograd.grad(out, leaves, dout)):
                result[name] = g
    return result


def dense_case(rng: random.Random, cap: Capability, small: bool, kind: str) -> Outcome:
    b = rng.randint(1, 3)
    sq = draw_len(rng, small)
    sk = sq if kind == "qkvpacked" else (draw_len(rng, small) if rng.random() < 0.7 else sq)
    heads_q, heads_kv = draw_heads(rng)
    if kind == "qkvpacked" and rng.random() < 0.5:
        heads_kv = heads_q  # the 5-D layout
    dtype = rng.choice(cap.dtypes)
    d = cap.draw_head_dim(rng, dtype)
    mask = draw_mask(rng, sq, sk)
    if rng.random() < 0.2:  # FA3's tests: a random chunk in [1, 2 seqlen_k)
        mask["attention_chunk"] = rng.randint(1, max(2 * sk - 1, 1))
    dv = d
    if kind == "dense" and rng.random() < 0.15:  # a V head dim of its own (FA3's dv != d)
        dv = rng.choice([8 * rng.randint(1, 32), 256, 512])
        width = max(d, min(dv, 256))  # what _dv.py pads q / k to
        if (dtype, cap.bucket(width)) not in cap.fwd:
            dv = d
    width = max(d, min(dv, 256))
    train = cap.has_bwd(dtype, width) and rng.random() < 0.6
    deterministic = rng.random() < 0.3
    want_lse = rng.random() < 0.5
    layout = rng.choice(["contiguous", "contiguous", "heads_first", "sliced"])
    config = dict(kind=kind, b=b, sq=sq, sk=sk, heads_q=heads_q, heads_kv=heads_kv, d=d, dv=dv,
                  dtype=str(dtype), train=train, deterministic=deterministic,
                  want_lse=want_lse, layout=layout, **mask)
    if kind == "qkvpacked":
        five = heads_kv == heads_q and rng.random() < 0.7
        config["five_dims"] = five
        shape = (b, sq, 3, heads_q, d) if five else (b, sq, heads_q + 2 * heads_kv, d)
        packed = torch.randn(shape, dtype=dtype, device="cuda")
        inputs = list(packed.unbind(2)) if five else list(
            packed.split([heads_q, heads_kv, heads_kv], dim=2))

        def call(leaves):
            # the gradient flows to one packed leaf; its parts are compared as dq, dk, dv
            qkv = (torch.stack(leaves, 2) if five else torch.cat(leaves, 2))
            return flash_hopper.flash_attn_qkvpacked_func(
                qkv, num_heads_q=None if five else heads_q, deterministic=deterministic,
                return_attn_probs=True, **mask)
    else:
        inputs = [randn((b, sq, heads_q, d), dtype, layout, rng),
                  randn((b, sk, heads_kv, d), dtype, layout, rng),
                  randn((b, sk, heads_kv, dv), dtype, layout, rng)]

        def call(leaves):
            return flash_hopper.flash_attn_func(*leaves, deterministic=deterministic,
                                                return_attn_probs=True, **mask)
    if mask.get("softcap"):
        inputs[0] = inputs[0] * (mask["softcap"] / 4)  # scores reach the cap, as FA3's tests
    dout = torch.randn(b, sq, heads_q, dv, dtype=dtype, device="cuda") if train else None
    got = _flash_results(call, inputs, dout, want_lse)

    def ref(leaves, upcast):
        return reference.attention_ref(*leaves, upcast=upcast, **mask)

    refs = reference_and_grads(ref, inputs, dout, True)
    lowps = reference_and_grads(ref, inputs, dout, False)
    algo = algorithm_grads(inputs, refs, dout, mask, dtype)
    return Outcome(kind, config, judge(got, refs, lowps, mask.get("softcap", 0.0), algo), 0.0)


def varlen_case(rng: random.Random, cap: Capability, small: bool) -> Outcome:
    n = rng.randint(1, 5)
    lens_q = [0 if rng.random() < 0.1 else draw_len(rng, True) for _ in range(n)]
    same = rng.random() < 0.5
    lens_k = list(lens_q) if same else [0 if rng.random() < 0.1 else draw_len(rng, True)
                                        for _ in range(n)]
    heads_q, heads_kv = draw_heads(rng)
    dtype = rng.choice(cap.dtypes)
    d = cap.draw_head_dim(rng, dtype)
    mask = draw_mask(rng, max(lens_q), max(lens_k))
    if rng.random() < 0.2:
        mask["attention_chunk"] = rng.randint(1, max(2 * max(lens_k) - 1, 1))
    train = cap.has_bwd(dtype, d) and rng.random() < 0.5
    config = dict(kind="varlen", lens_q=lens_q, lens_k=lens_k, heads_q=heads_q,
                  heads_kv=heads_kv, d=d, dtype=str(dtype), train=train, **mask)
    cu_q = torch.tensor([0] + list(_cumsum(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32, device="cuda")
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    inputs = [torch.randn(tq, heads_q, d, dtype=dtype, device="cuda"),
              torch.randn(tk, heads_kv, d, dtype=dtype, device="cuda"),
              torch.randn(tk, heads_kv, d, dtype=dtype, device="cuda")]
    if mask.get("softcap"):
        inputs[0] = inputs[0] * (mask["softcap"] / 4)
    max_q, max_k = max(lens_q), max(lens_k)

    def call(leaves):
        return flash_hopper.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k,
                                                   return_attn_probs=True, **mask)

    dout = torch.randn(tq, heads_q, d, dtype=dtype, device="cuda") if train else None
    got = _flash_results(call, inputs, dout, True)
    ref_mask = {k: v for k, v in mask.items()}

    def ref(leaves, upcast):
        with torch.enable_grad() if leaves[0].requires_grad else torch.no_grad():
            return _varlen_ref(leaves, cu_q, cu_k, upcast, **ref_mask)

    refs = reference_and_grads(ref, inputs, dout, True)
    lowps = reference_and_grads(ref, inputs, dout, False)
    algo = {}
    if dout is not None:  # algorithm_grads per sequence, into zeros (keys no query sees: 0)
        algo = {name: torch.zeros_like(t, dtype=torch.float64)
                for name, t in zip(("dq", "dk", "dv"), inputs)}
        starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
        for i in range(len(starts_q) - 1):
            q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
            if q1 == q0 or k1 == k0:  # no queries, or no keys: every gradient is 0
                continue
            seq = [inputs[0][None, q0:q1], inputs[1][None, k0:k1], inputs[2][None, k0:k1]]
            seq_refs = {"out": refs["out"][None, q0:q1], "lse": refs["lse"][None, :, q0:q1]}
            grads = algorithm_grads(seq, seq_refs, dout[None, q0:q1], mask, dtype)
            algo["dq"][q0:q1] = grads["dq"][0]
            algo["dk"][k0:k1] = grads["dk"][0]
            algo["dv"][k0:k1] = grads["dv"][0]
    return Outcome("varlen", config, judge(got, refs, lowps, mask.get("softcap", 0.0), algo),
                   0.0)


def _varlen_ref(leaves, cu_q, cu_k, upcast, **mask):
    """attention_varlen_ref's per-sequence loop, differentiable (that one runs under no_grad)."""
    q, k, v = leaves
    outs, lses = [], []
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[i], starts_q[i + 1], starts_k[i], starts_k[i + 1]
        if q1 == q0:
            continue
        o, lse = reference.attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                         upcast=upcast, **mask)
        outs.append(o[0])
        lses.append(lse[0])
    if not outs:
        return (q.new_zeros(0, q.shape[1], v.shape[2]),
                q.new_zeros(q.shape[1], 0, dtype=torch.float32))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def kvcache_case(rng: random.Random, cap: Capability, small: bool) -> Outcome:
    b = rng.randint(1, 4)
    sq = rng.choice([1, 1, 2, rng.randint(1, 16), rng.randint(16, 200)])
    seqlen_cache = rng.randint(max(sq, 8), 700 if not small else 200)
    new = rng.choice([0, 0, rng.randint(1, min(8, seqlen_cache))])
    heads_q, heads_kv = draw_heads(rng)
    dtype = rng.choice(cap.dtypes)
    d = cap.draw_head_dim(rng, dtype)
    filled = [rng.randint(0, seqlen_cache - new) for _ in range(b)]
    mask = draw_mask(rng, sq, seqlen_cache)
    permuted = rng.random() < 0.4
    batch_cache = b + rng.randint(0, 2) if permuted else b  # more rows need cache_batch_idx
    config = dict(kind="kvcache", b=b, sq=sq, seqlen_cache=seqlen_cache, new=new,
                  filled=filled, heads_q=heads_q, heads_kv=heads_kv, d=d, dtype=str(dtype),
                  batch_cache=batch_cache, permuted=permuted, **mask)
    q = torch.randn(b, sq, heads_q, d, dtype=dtype, device="cuda")
    if mask.get("softcap"):
        q = q * (mask["softcap"] / 4)
    k_cache = torch.randn(batch_cache, seqlen_cache, heads_kv, d, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(b, new, heads_kv, d, dtype=dtype, device="cuda") if new else None
    v_new = torch.randn_like(k_new) if new else None
    seqlens = torch.tensor(filled, dtype=torch.int32, device="cuda")
    batch_idx = (torch.randperm(batch_cache, device="cuda")[:b].to(torch.int32)
                 if permuted else None)
    ref_out, ref_lse, ref_k, ref_v = reference.attention_kvcache_ref(
        q, k_cache, v_cache, k_new, v_new, seqlens, batch_idx, **mask)
    low_out, _, _, _ = reference.attention_kvcache_ref(
        q, k_cache, v_cache, k_new, v_new, seqlens, batch_idx, upcast=False, **mask)
    out, lse = flash_hopper.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, cache_batch_idx=batch_idx,
        return_softmax_lse=True, **mask)
    problems = judge({"out": out, "lse": lse}, {"out": ref_out, "lse": ref_lse},
                     {"out": low_out}, mask.get("softcap", 0.0))
    if not (torch.equal(k_cache, ref_k.to(dtype)) and torch.equal(v_cache, ref_v.to(dtype))):
        problems.append("k_cache / v_cache: not the reference's after the append")
    return Outcome("kvcache", config, problems, 0.0)


# --- serving hazards -----------------------------------------------------------------------------
#
# A hazard case is one call of flash_attn_func, flash_attn_varlen_func or flash_attn_with_kvcache
# (a dense or a paged cache) with adversarial values: offsets, lengths, indices and page-table
# entries out of range or huge, huge windows, expanded / strided / offset index tensors and page
# tables, out= a slice of a sentinel-filled buffer. It runs twice: with the library's value checks
# on, then off (FLASH_HOPPER_CHECK_OFFSETS=0, read per call). Whatever a call does, nothing outside
# out and the caches may change; a refusal is a TypeError / ValueError / NotImplementedError
# naming an argument and leaves the caches as they were; a result holds no NaN (the inputs hold
# none; every buffer around them does, so a read past a tensor shows); a call with the checks on
# must refuse values out of contract; a result for values within it matches the float64
# reference; and the device must still synchronize. Wrong results for unchecked bad values are
# allowed, memory unsafety is not. The values are drawn in plain Python (draw_hazard: testable
# without a GPU), build_hazard makes the tensors, run_hazard calls and judges, hazard_outcome runs
# both.

CHECK_OFFSETS_ENV = "FLASH_HOPPER_CHECK_OFFSETS"
OUT_SENTINEL = 5.0  # fills out's buffer: only the slice may be written
GUARD_SENTINEL = math.nan  # fills the inputs' and caches' buffers: a read past a tensor is a NaN
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
HUGE_WINDOWS = (INT32_MAX, 2**32, 2**40)
# The decode kernel's head dims and packed rows (seqlen_q x heads_q / heads_kv) at most, as the
# library's table has them (build_info "decode"; test_fuzz.py checks they agree): the draws aim
# half of the short-query shapes at its route.
DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_ROWS = 128

HAZARD_CATEGORIES = (
    # offsets and lengths
    "cu_decreasing", "cu_negative", "cu_past_total", "cu_huge", "cu_wrong_last",
    "seqused_past_span", "seqused_negative", "max_seqlen_q_short",
    # indices
    "batch_idx_negative", "batch_idx_past_cache", "batch_idx_past_table", "batch_idx_duplicated",
    "leftpad_negative", "leftpad_past_length", "seqlens_negative", "seqlens_past_capacity",
    # page tables
    "page_negative_used", "page_past_pool_used", "page_negative_unused", "page_past_pool_unused",
    "table_strided", "table_expanded", "table_transposed",
    # windows
    "window_huge", "window_huge_causal",
    # layouts of index tensors, out and the caches
    "index_expanded", "index_strided", "index_offset", "out_rows_slice", "out_heads_slice",
    "kv_one_buffer",
)


@dataclass
class HazardDraw:
    """One hazard call, described by plain Python values (drawn without a GPU or tensors)."""

    entry: str  # "dense" (flash_attn_func), "varlen", "kvcache" (a dense cache) or "paged"
    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_kv: int
    checks: bool  # this run's value checks: on (variable unset) or off ("0"); both are run
    decode: bool  # a short-query shape (the decode kernel's): at most DECODE_ROWS packed rows
    junk: int  # what strided / offset index tensors hold around their entries
    sizes: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)  # argument -> int, list, list of rows
    layouts: dict[str, str] = field(default_factory=dict)  # index argument -> its layout
    mask: dict[str, Any] = field(default_factory=dict)
    out_layout: str = "rows"  # out a slice of its buffer's rows, or of its rows and heads
    out_pad: int = 1  # sentinel rows before and after out in its buffer
    want_lse: bool = False
    kv_one_buffer: bool = False  # k_cache and v_cache views of one buffer (vLLM's layout)
    hazards: list[str] = field(default_factory=list)  # the HAZARD_CATEGORIES drawn
    violations: list[str] = field(default_factory=list)  # "argument: why", out of contract
    unspecified: list[str] = field(default_factory=list)  # valid, but no one right answer
    hint: bool = False  # max_seqlen_q / _k below a sequence's length: honoured only when checked

    @property
    def judged(self) -> bool:
        """Whether a result must match the reference: values within the contract, one right
        answer, and no short max_seqlen hint unless the library reads the offsets itself."""
        return not self.violations and not self.unspecified and (self.checks or not self.hint)

    def config(self) -> dict[str, Any]:
        """The draw as JSON-ready values: the report's config (--replay hazard:SEED rebuilds the
        call itself, tensors included)."""
        return {"kind": "hazard", "entry": self.entry, "dtype": str(self.dtype),
                "head_dim": self.head_dim, "heads_q": self.heads_q, "heads_kv": self.heads_kv,
                "decode": self.decode, "junk": self.junk,
                **copy.deepcopy({"sizes": self.sizes, "values": self.values,
                                 "layouts": self.layouts, "mask": self.mask}),
                "out_layout": self.out_layout, "out_pad": self.out_pad,
                "want_lse": self.want_lse, "kv_one_buffer": self.kv_one_buffer,
                "hazards": list(self.hazards), "violations": list(self.violations),
                "unspecified": list(self.unspecified), "hint": self.hint}


def _int32(x: int) -> int:
    return max(INT32_MIN, min(INT32_MAX, x))


def _negative(rng: random.Random) -> int:
    return rng.choice([-1, -rng.randint(2, 9), INT32_MIN])


def _longest(cu: list[int]) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


def _query_count(rng: random.Random, decode: bool, group: int, small: bool) -> int:
    """Query tokens of one sequence: a decode shape packs at most DECODE_ROWS rows (tokens x
    the query heads of a KV head), the others more (the varlen kernels' route)."""
    limit = max(DECODE_ROWS // group, 1)
    if decode:
        return min(rng.choice([1, 1, 2, rng.randint(1, limit)]), limit)
    return rng.randint(limit + 1, limit + (60 if small else 300))


def _hazard_head_dim(rng: random.Random, cap: Capability, dtype: torch.dtype,
                     decode: bool) -> int:
    served = [d for d in DECODE_HEAD_DIMS if d in cap.buckets and (dtype, d) in cap.fwd]
    if decode and served:
        return rng.choice(served)
    return cap.draw_head_dim(rng, dtype)


def _packed(rng: random.Random, lens: list[int], from_zero: bool) -> tuple[list[int], int]:
    """Offsets of sequences of ``lens`` tokens and the tokens of the tensor: unless from_zero
    (the KV cache's cu_seqlens_q), the first may start past 0 and tokens may follow the last
    (both valid, never read)."""
    cu = [0 if from_zero or rng.random() < 0.7 else rng.randint(1, 3)]
    for n in lens:
        cu.append(cu[-1] + n)
    tail = 0 if from_zero or rng.random() < 0.6 else rng.randint(1, 5)
    return cu, cu[-1] + tail


def _draw_layout(rng: random.Random, draw: HazardDraw, names: list[str]) -> None:
    """Maybe one index argument laid out as an expanded, strided or offset view."""
    if not names or rng.random() >= 0.35:
        return
    name = rng.choice(names)
    layout = rng.choice(["expanded", "strided", "offset"])
    if layout == "expanded":  # one value broadcast: beam search's zeros(1).expand(batch)
        draw.values[name] = [draw.values[name][0]] * len(draw.values[name])
    draw.layouts[name] = layout
    draw.hazards.append(f"index_{layout}")


def _apply_hazards(rng: random.Random, draw: HazardDraw, generators: list[Any]) -> None:
    """None, one or two of the generators (each: the category it applied, or None where the
    draw has nothing it applies to)."""
    count = rng.choices([0, 1, 2], weights=[3, 5, 2])[0]
    for generator in rng.sample(generators, min(count, len(generators))):
        category = generator(rng, draw)
        if category:
            draw.hazards.append(category)


def _offsets_target(rng: random.Random, draw: HazardDraw) -> tuple[list[int], int] | None:
    """An offsets list the hazards may break (not an expanded one) and its tensor's tokens."""
    names = [name for name in ("cu_seqlens_q", "cu_seqlens_k")
             if name in draw.values and draw.layouts.get(name) != "expanded"]
    if not names:
        return None
    name = rng.choice(names)
    return draw.values[name], draw.sizes["total_q" if name == "cu_seqlens_q" else "total_k"]


def _cu_decreasing(rng: random.Random, draw: HazardDraw) -> str | None:
    target = _offsets_target(rng, draw)
    if target is None:
        return None
    cu, _ = target
    i = rng.randint(1, len(cu) - 1)
    cu[i] = _int32(cu[i - 1] - rng.randint(1, 5))
    return "cu_decreasing"


def _cu_negative(rng: random.Random, draw: HazardDraw) -> str | None:
    target = _offsets_target(rng, draw)
    if target is None:
        return None
    cu, _ = target
    cu[rng.randint(0, len(cu) - 1)] = _negative(rng)
    return "cu_negative"


def _cu_past_total(rng: random.Random, draw: HazardDraw) -> str | None:
    target = _offsets_target(rng, draw)
    if target is None:
        return None
    cu, total = target
    i = rng.randint(1, len(cu) - 1)
    shift = total + rng.choice([1, rng.randint(2, 64)]) - cu[-1]
    for j in range(i, len(cu)):  # still non-decreasing: past the tokens alone
        cu[j] = _int32(cu[j] + shift)
    return "cu_past_total"


def _cu_huge(rng: random.Random, draw: HazardDraw) -> str | None:
    target = _offsets_target(rng, draw)
    if target is None:
        return None
    cu, _ = target
    for j in range(rng.randint(1, len(cu) - 1), len(cu)):
        cu[j] = INT32_MAX
    return "cu_huge"


def _cu_wrong_last(rng: random.Random, draw: HazardDraw) -> str | None:
    """Another last offset: shorter (valid: tokens past it unread), longer (valid up to the
    tokens), past the tokens or below the one before it."""
    target = _offsets_target(rng, draw)
    if target is None:
        return None
    cu, total = target
    old = cu[-1]
    choices = [cu[-2], old - 1, old + 1, total, total + 1,
               rng.randint(min(cu[-2], total), max(cu[-2], total) + 8)]
    cu[-1] = _int32(rng.choice([c for c in choices if c != old] or [old + 1]))
    return "cu_wrong_last"


def _seqused(rng: random.Random, draw: HazardDraw, past: bool) -> str | None:
    if draw.entry != "varlen" or draw.layouts.get("seqused_k") == "expanded":
        return None
    cu = draw.values["cu_seqlens_k"]
    # a span past int32 (an offset already broken to -2^31) is not an int32 length: clamped
    spans = [_int32(max(b - a, 0)) for a, b in zip(cu, cu[1:])]
    used = draw.values.setdefault("seqused_k", list(spans))
    b = rng.randrange(len(used))
    if past:
        used[b] = _int32(rng.choice([spans[b] + 1, spans[b] + rng.randint(2, 64), INT32_MAX]))
        return "seqused_past_span"
    used[b] = _negative(rng)
    return "seqused_negative"


def _max_seqlen_q_short(rng: random.Random, draw: HazardDraw) -> str | None:
    """max_seqlen_q below a sequence's query count (a hint: checked calls find the longest),
    never above the drawn lengths (unchecked calls size their grid by it)."""
    cu = draw.values.get("cu_seqlens_q")
    if cu is None:
        return None
    longest = min(_longest(cu), max(draw.sizes["lens_q"]))
    if longest < 1:
        return None
    draw.values["max_seqlen_q"] = rng.randint(0, longest - 1)
    return "max_seqlen_q_short"


def _batch_idx(rng: random.Random, draw: HazardDraw, kind: str) -> str | None:
    if draw.layouts.get("cache_batch_idx") == "expanded":
        return None
    paged = draw.entry == "paged"
    batch = draw.sizes["batch"]
    rows = draw.sizes["table_rows" if paged else "batch_cache"]
    idx = draw.values.setdefault("cache_batch_idx", list(range(batch)))  # rows == batch then
    j = rng.randrange(batch)
    if kind == "negative":
        idx[j] = _negative(rng)
        return "batch_idx_negative"
    if kind == "past":
        idx[j] = rng.choice([rows, rows + rng.randint(1, 8), INT32_MAX])
        return "batch_idx_past_table" if paged else "batch_idx_past_cache"
    if batch < 2:
        return None
    idx[j] = idx[(j + rng.randint(1, batch - 1)) % batch]
    return "batch_idx_duplicated"


def _leftpad(rng: random.Random, draw: HazardDraw, negative: bool) -> str | None:
    if draw.layouts.get("cache_leftpad") == "expanded":
        return None
    lengths, new = draw.values["cache_seqlens"], draw.sizes["new"]
    lead = draw.values.setdefault("cache_leftpad", [0] * len(lengths))
    j = rng.randrange(len(lead))
    if negative:
        lead[j] = _negative(rng)
        return "leftpad_negative"
    end = lengths[j] + new
    lead[j] = _int32(rng.choice([end + 1, end + rng.randint(2, 64), INT32_MAX]))
    return "leftpad_past_length"


def _seqlens(rng: random.Random, draw: HazardDraw, negative: bool) -> str | None:
    if draw.layouts.get("cache_seqlens") == "expanded":
        return None
    lengths = draw.values["cache_seqlens"]
    j = rng.randrange(len(lengths))
    if negative:
        lengths[j] = _negative(rng)
        return "seqlens_negative"
    room = draw.sizes["capacity"] - draw.sizes["new"]
    lengths[j] = _int32(rng.choice([room + 1, room + rng.randint(2, 64), INT32_MAX]))
    return "seqlens_past_capacity"


def _used_pages_by_row(draw: HazardDraw) -> dict[int, int]:
    """Page-table row -> the columns some sequence reading it uses (the pages below its length
    plus its new keys, lengths clamped to the capacity); an expanded table's rows are one row."""
    sizes, idx = draw.sizes, draw.values.get("cache_batch_idx")
    used: dict[int, int] = {}
    for j, length in enumerate(draw.values["cache_seqlens"]):
        row = idx[j] if idx is not None else j
        keys = min(min(max(length, 0), sizes["capacity"]) + sizes["new"], sizes["capacity"])
        used[row] = max(used.get(row, 0), -(-keys // sizes["page_size"]))
    if draw.layouts.get("page_table") == "expanded":
        most = max(used.values(), default=0)
        used = {row: most for row in range(sizes["table_rows"])}
    return used


def _page_entry(rng: random.Random, draw: HazardDraw, used: bool, negative: bool) -> str | None:
    """One page-table entry out of the pool: in a column a sequence uses (the library must
    refuse or clamp it) or in one none does (valid: unused entries may hold anything)."""
    if draw.entry != "paged":
        return None
    table, num_pages = draw.values["page_table"], draw.sizes["num_pages"]
    by_row = _used_pages_by_row(draw)
    columns = len(table[0])
    if used:
        spots = [(r, c) for r, n in by_row.items() if 0 <= r < len(table)
                 for c in range(min(n, columns))]
    else:
        spots = [(r, c) for r in range(len(table)) for c in range(by_row.get(r, 0), columns)]
    if not spots:
        return None
    r, c = rng.choice(spots)
    value = _negative(rng) if negative else rng.choice(
        [num_pages, num_pages + rng.randint(1, 8), INT32_MAX])
    for row in table if draw.layouts.get("page_table") == "expanded" else [table[r]]:
        row[c] = value
    return f"page_{'negative' if negative else 'past_pool'}_{'used' if used else 'unused'}"


# Each generator: (rng, draw) -> the category it applied, or None where it does not apply.
_OFFSET_HAZARDS = [_cu_decreasing, _cu_negative, _cu_past_total, _cu_huge, _cu_wrong_last,
                   _max_seqlen_q_short]
_SEQUSED_HAZARDS = [functools.partial(_seqused, past=past) for past in (True, False)]
_INDEX_HAZARDS = ([functools.partial(_batch_idx, kind=kind)
                   for kind in ("negative", "past", "duplicated")]
                  + [functools.partial(f, negative=negative) for f in (_leftpad, _seqlens)
                     for negative in (True, False)])
_PAGE_HAZARDS = [functools.partial(_page_entry, used=used, negative=negative)
                 for used in (True, False) for negative in (True, False)]


def _draw_dense(rng: random.Random, draw: HazardDraw, small: bool) -> tuple[int, int]:
    group = draw.heads_q // draw.heads_kv
    sq, sk = _query_count(rng, draw.decode, group, small), draw_len(rng, small)
    draw.sizes.update(batch=rng.randint(1, 3), seqlen_q=sq, seqlen_k=sk)
    return sq, sk


def _draw_varlen(rng: random.Random, draw: HazardDraw, small: bool) -> tuple[int, int]:
    group = draw.heads_q // draw.heads_kv
    n = rng.randint(1, 4)
    lens_q = [0 if rng.random() < 0.1 else _query_count(rng, draw.decode, group, small)
              for _ in range(n)]
    lens_k = [0 if rng.random() < 0.1 else draw_len(rng, small) for _ in range(n)]
    cu_q, total_q = _packed(rng, lens_q, False)
    cu_k, total_k = _packed(rng, lens_k, False)
    draw.sizes.update(batch=n, total_q=total_q, total_k=total_k, packed_q=True, lens_q=lens_q,
                      lens_k=lens_k)
    draw.values.update(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                       max_seqlen_k=max(lens_k))
    if rng.random() < 0.3:  # padded layouts: the used prefix of each span
        draw.values["seqused_k"] = [rng.randint(0, n_k) for n_k in lens_k]
    _draw_layout(rng, draw, [name for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k")
                             if name in draw.values])
    _apply_hazards(rng, draw, _OFFSET_HAZARDS + _SEQUSED_HAZARDS)
    return max(lens_q), max(lens_k)


def _draw_kvcache(rng: random.Random, draw: HazardDraw, small: bool) -> tuple[int, int]:
    paged = draw.entry == "paged"
    group = draw.heads_q // draw.heads_kv
    batch = rng.randint(1, 4)
    packed_q = rng.random() < 0.25  # varlen queries: q (total_q, ...) with cu_seqlens_q
    lens_q = [_query_count(rng, draw.decode, group, small) for _ in range(batch)]
    seqlen_q = max(lens_q) if packed_q else lens_q[0]
    new = rng.choice([0, 0, rng.randint(1, 8)])
    wanted = rng.randint(8, 200 if small else 600)
    with_idx = rng.random() < (0.3 if paged else 0.5)
    rows = batch + (rng.randint(0, 2) if with_idx else 0)  # cache entries, or page-table rows
    if paged:
        page_size = rng.choice([1, 2, 5, 16, 64])
        max_pages = -(-wanted // page_size)
        capacity = max_pages * page_size
        num_pages = rows * max_pages + rng.randint(0, 3)
        pool = rng.sample(range(num_pages), rows * max_pages)  # no page shared between rows
        draw.values["page_table"] = [pool[r * max_pages:(r + 1) * max_pages] for r in range(rows)]
        draw.sizes.update(page_size=page_size, max_pages=max_pages, num_pages=num_pages,
                          table_rows=rows)
    else:
        capacity = wanted
        draw.sizes.update(seqlen_cache=capacity, batch_cache=rows)
    draw.sizes.update(batch=batch, new=new, capacity=capacity, packed_q=packed_q)
    draw.values["cache_seqlens"] = [rng.randint(0, capacity - new) for _ in range(batch)]
    if with_idx:
        draw.values["cache_batch_idx"] = rng.sample(range(rows), batch)
    if rng.random() < 0.3:
        draw.values["cache_leftpad"] = [rng.randint(0, n + new)
                                        for n in draw.values["cache_seqlens"]]
    if packed_q:
        cu, total = _packed(rng, lens_q, True)
        draw.values.update(cu_seqlens_q=cu, max_seqlen_q=seqlen_q)
        draw.sizes.update(total_q=total, lens_q=lens_q)
    else:
        draw.sizes["seqlen_q"] = seqlen_q
    if paged and rng.random() < 0.3:  # entries no sequence uses may hold any page
        table, by_row = draw.values["page_table"], _used_pages_by_row(draw)
        for r, row in enumerate(table):
            for c in range(by_row.get(r, 0), len(row)):
                row[c] = rng.randrange(num_pages) if rng.random() < 0.5 else row[c]
    if rng.random() < 0.25:
        draw.kv_one_buffer = True
        draw.hazards.append("kv_one_buffer")
    if paged and rng.random() < 0.4:
        layout = rng.choice(["strided", "expanded", "transposed"])
        if layout == "expanded":  # beam search: every row is the first
            table = draw.values["page_table"]
            table[:] = [list(table[0]) for _ in table]
        draw.layouts["page_table"] = layout
        draw.hazards.append(f"table_{layout}")
    _draw_layout(rng, draw, [name for name in ("cache_seqlens", "cache_batch_idx",
                                               "cache_leftpad", "cu_seqlens_q")
                             if name in draw.values])
    generators = list(_INDEX_HAZARDS)
    if packed_q:
        generators += _OFFSET_HAZARDS
    if paged:
        generators += _PAGE_HAZARDS
    _apply_hazards(rng, draw, generators)
    return seqlen_q, capacity


def _huge_window(rng: random.Random, draw: HazardDraw) -> None:
    """window_size with a bound of 2**31 - 1, 2**32 or 2**40 (int32 arithmetic on it wraps),
    with causal (which keeps the left bound) or without."""
    sides = [rng.choice(HUGE_WINDOWS + (-1, rng.randint(0, 64))) for _ in range(2)]
    causal = rng.random() < 0.5
    if causal or not any(side in HUGE_WINDOWS for side in sides):
        sides[0 if causal else rng.randrange(2)] = rng.choice(HUGE_WINDOWS)
    draw.mask["window_size"] = tuple(sides)
    draw.mask["causal"] = causal
    draw.hazards.append("window_huge_causal" if causal else "window_huge")


def draw_hazard(rng: random.Random, cap: Capability, small: bool) -> HazardDraw:
    """A hazard call's values (the section comment): entry point, shapes (about half of them
    short-query decode shapes at the decode kernel's head dims), adversarial values and layouts,
    the mask (maybe a huge window), out's slice; then which values break the contract
    (hazard_violations). Plain Python: no GPU, no tensors. ``checks`` is True: hazard_outcome
    runs the draw with the checks on and again with them off."""
    entry = rng.choice(["dense", "varlen", "varlen", "kvcache", "kvcache", "paged", "paged"])
    dtype = rng.choice(cap.dtypes)
    heads_q, heads_kv = draw_heads(rng)
    decode = rng.random() < 0.5
    draw = HazardDraw(entry, dtype, _hazard_head_dim(rng, cap, dtype, decode), heads_q, heads_kv,
                      checks=True, decode=decode, junk=rng.choice([-1, 7, INT32_MAX, INT32_MIN]))
    if entry == "dense":
        sq, sk = _draw_dense(rng, draw, small)
    elif entry == "varlen":
        sq, sk = _draw_varlen(rng, draw, small)
    else:
        sq, sk = _draw_kvcache(rng, draw, small)
    draw.mask = draw_mask(rng, sq, sk)
    if rng.random() < (0.7 if entry == "dense" else 0.3):
        _huge_window(rng, draw)
    if entry != "dense":  # flash_attn_func takes no out=
        draw.out_layout = rng.choice(["rows", "rows", "heads"])
        draw.out_pad = rng.choice([1, 7, 100] if draw.sizes["packed_q"] else [1, 2])
        draw.hazards.append(f"out_{draw.out_layout}_slice")
    draw.want_lse = rng.random() < 0.5
    draw.violations, draw.unspecified, draw.hint = hazard_violations(draw)
    return draw


def _offset_violations(name: str, cu: list[int], total: int, from_zero: bool) -> list[str]:
    """Offsets start at 0 (from_zero: the KV cache's cu_seqlens_q) or >= 0, never decrease,
    and end within the tensor's tokens."""
    found = []
    if from_zero and cu[0] != 0:
        found.append(f"{name}: {name}[0] = {cu[0]}, not 0")
    elif cu[0] < 0:
        found.append(f"{name}: {name}[0] = {cu[0]} < 0")
    falls = [i for i in range(1, len(cu)) if cu[i] < cu[i - 1]]
    if falls:
        found.append(f"{name}: {cu[falls[0] - 1]} then {cu[falls[0]]} at index {falls[0]}")
    if cu[-1] > total:
        found.append(f"{name}: last offset {cu[-1]} past the {total} tokens")
    return found


def hazard_violations(draw: HazardDraw) -> tuple[list[str], list[str], bool]:
    """The contract, from the values alone (the API docstrings): (violations, "argument: why",
    values a checked call must refuse and an unchecked one may answer wrongly but safely;
    unspecified, valid values without one right answer (two new keys written to one cache
    slot, FA3's "which write lands is unspecified"); hint, max_seqlen_q / max_seqlen_k below a
    sequence's length, which only a checked call corrects)."""
    values, sizes = draw.values, draw.sizes
    violations: list[str] = []
    unspecified: list[str] = []
    if draw.entry == "dense":
        return violations, unspecified, False
    if draw.entry == "varlen":
        cu_q, cu_k = values["cu_seqlens_q"], values["cu_seqlens_k"]
        violations += _offset_violations("cu_seqlens_q", cu_q, sizes["total_q"], False)
        violations += _offset_violations("cu_seqlens_k", cu_k, sizes["total_k"], False)
        for b, used in enumerate(values.get("seqused_k") or []):
            span = cu_k[b + 1] - cu_k[b]
            if not 0 <= used <= span:
                violations.append(f"seqused_k: seqused_k[{b}] = {used} outside [0, {span}]")
        hint = (_longest(cu_q) > values["max_seqlen_q"]
                or _longest(cu_k) > values["max_seqlen_k"])
        return violations, unspecified, hint
    paged = draw.entry == "paged"
    new, capacity = sizes["new"], sizes["capacity"]
    hint = False
    if "cu_seqlens_q" in values:
        cu = values["cu_seqlens_q"]
        violations += _offset_violations("cu_seqlens_q", cu, sizes["total_q"], True)
        hint = _longest(cu) > values["max_seqlen_q"]
    rows = sizes["table_rows" if paged else "batch_cache"]
    idx, lead = values.get("cache_batch_idx"), values.get("cache_leftpad")
    written = []  # the cache entries (pages) holding each sequence's keys
    for b, length in enumerate(values["cache_seqlens"]):
        ok = 0 <= length <= capacity - new
        if not ok:
            violations.append(f"cache_seqlens: cache_seqlens[{b}] = {length} outside "
                              f"[0, {capacity - new}]")
        row = b if idx is None else idx[b]
        if not 0 <= row < rows:
            violations.append(f"cache_batch_idx: cache_batch_idx[{b}] = {row} outside "
                              f"[0, {rows})")
            ok = False
        if lead is not None and not 0 <= lead[b] <= length + new:
            violations.append(f"cache_leftpad: cache_leftpad[{b}] = {lead[b]} outside "
                              f"[0, {length + new}]")
        if not ok:
            continue
        if not paged:
            written.append(row)
            continue
        table, num_pages = values["page_table"], sizes["num_pages"]
        for c in range(-(-(length + new) // sizes["page_size"])):
            page = table[row][c]
            if 0 <= page < num_pages:
                written.append(page)
            else:
                violations.append(f"page_table: page_table[{row}][{c}] = {page} (used by "
                                  f"sequence {b}) outside [0, {num_pages})")
    if new and not violations and len(set(written)) < len(written):
        what = "page_table: a page" if paged else "cache_batch_idx: a cache entry"
        unspecified.append(f"{what} of two sequences (or twice in one) with new keys")
    return violations, unspecified, hint


# --- hazard checks (plain torch: they run on CPU tensors too) ------------------------------------

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements in logical order as integers of their width: a bitwise comparison (NaN
    equals the same NaN, -0.0 differs from 0.0)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def guard_check(buffer: torch.Tensor, inside: Any, sentinel: float,
                name: str = "buffer") -> str | None:
    """None when every element of ``buffer`` outside ``inside`` (an index of it: a tuple of
    slices, an index tensor, or a list of such) still holds ``sentinel`` bit for bit; else how
    many changed and the first."""
    mask = torch.ones(buffer.shape, dtype=torch.bool, device=buffer.device)
    for part in inside if isinstance(inside, list) else [inside]:
        mask[part] = False
    want = _bits(torch.full((1,), sentinel, dtype=buffer.dtype, device=buffer.device))
    changed = (_bits(buffer) != want).reshape(buffer.shape) & mask
    count = int(changed.sum())
    if not count:
        return None
    first = tuple(int(i) for i in changed.nonzero()[0])
    return (f"{name}: {count} element(s) outside the slice changed, the first at {first} "
            f"({buffer[first].item()!r}, sentinel {sentinel})")


def cache_unchanged(before: dict[str, torch.Tensor],
                    after: dict[str, torch.Tensor]) -> str | None:
    """None when each tensor of ``after`` equals its clone in ``before`` (same names) bit for
    bit; else which changed and in how many elements."""
    changed = []
    for name, old in before.items():
        now = after[name]
        if now.shape != old.shape:
            changed.append(f"{name}: shape {tuple(old.shape)} -> {tuple(now.shape)}")
            continue
        count = int((_bits(old) != _bits(now)).sum())
        if count:
            changed.append(f"{name}: {count} of {old.numel()} element(s)")
    return "; ".join(changed) or None


def refusal_problem(error: BaseException, arguments: Any) -> str | None:
    """None when ``error`` is a refusal: TypeError, ValueError or NotImplementedError
    (flash_hopper's UnsupportedError is one) whose message names one of ``arguments`` (the
    call's argument names) the way the library's messages do: the whole word, maybe indexed,
    then ':', '/', '=' or "'s" ("cache_seqlens: ...", "window_size[0]: ...", "k / v: ...",
    "q's dtype"); a bare word would let "index out of range" name ``out``. Else what is wrong."""
    message, names = str(error), list(arguments)
    if not isinstance(error, ALLOWED):
        return (f"raised {type(error).__name__}, not TypeError / ValueError / "
                f"NotImplementedError: {message[:200]}")
    if not any(re.search(rf"(?<![\w.]){re.escape(name)}(?:\[[^\]]*\])*(?:\s*[:/=]|'s)", message)
               for name in names):
        return (f"{type(error).__name__} names none of the call's arguments "
                f"({', '.join(names)}): {message[:200]}")
    return None


@contextlib.contextmanager
def offset_checks(on: bool):
    """The library's value checks on (FLASH_HOPPER_CHECK_OFFSETS unset) or off ("0") for the
    block; the variable as it was after it."""
    previous = os.environ.get(CHECK_OFFSETS_ENV)
    if on:
        os.environ.pop(CHECK_OFFSETS_ENV, None)
    else:
        os.environ[CHECK_OFFSETS_ENV] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(CHECK_OFFSETS_ENV, None)
        else:
            os.environ[CHECK_OFFSETS_ENV] = previous


# --- hazard tensors, call and judgement ----------------------------------------------------------


@dataclass
class HazardCall:
    """A hazard draw's tensors: the call, and what must hold after it."""

    fn: Any
    kwargs: dict[str, Any]
    guards: list[tuple[str, torch.Tensor, Any, float]] = field(default_factory=list)
    watched: dict[str, torch.Tensor] = field(default_factory=dict)  # never changed, whole
    caches: dict[str, torch.Tensor] = field(default_factory=dict)  # whole cache buffers
    clean: dict[str, torch.Tensor] = field(default_factory=dict)  # index values, contiguous
    out: torch.Tensor | None = None


def guarded(shape: tuple[int, ...], dtype: torch.dtype, device: Any, fill: float, pad: int = 1,
            heads_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(view, buffer, index): a ``shape`` view inside a buffer filled with ``fill`` and ``pad``
    more entries before and after it along dim 0 (and ``heads_pad`` more heads, dim -2, around
    it); buffer[index] is the view."""
    size = [shape[0] + 2 * pad, *shape[1:]]
    size[-2] += 2 * heads_pad
    buffer = torch.full(size, fill, dtype=dtype, device=device)
    index = [slice(None)] * len(shape)
    index[0] = slice(pad, pad + shape[0])
    index[-2] = slice(heads_pad, heads_pad + shape[-2])
    return buffer[tuple(index)], buffer, tuple(index)


def index_tensor(values: list[int], layout: str, device: Any,
                 junk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(an int32 tensor of ``values``, the buffer it views): "contiguous"; "expanded", its first
    value broadcast (stride 0); "strided", every other entry of a buffer with ``junk`` between
    them (t[::2]); "offset", the middle of a buffer with ``junk`` on both sides."""
    n = len(values)
    if layout == "expanded":
        base = torch.tensor(values[:1], dtype=torch.int32, device=device)
        return base.expand(n), base
    if layout == "strided":
        base = torch.full((2 * n,), junk, dtype=torch.int32, device=device)
        base[::2] = torch.tensor(values, dtype=torch.int32, device=device)
        return base[::2], base
    if layout == "offset":
        base = torch.tensor([junk, *values, junk], dtype=torch.int32, device=device)
        return base[1:-1], base
    base = torch.tensor(values, dtype=torch.int32, device=device)
    return base, base


def table_tensor(rows: list[list[int]], layout: str, device: Any,
                 junk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(an int32 page table of ``rows``, the buffer it views): "contiguous"; "strided", the
    [:, ::2] view of a buffer with ``junk`` in the other columns; "expanded", the first row
    expand()ed (beam search); "transposed", the .t() of a contiguous transpose."""
    full = torch.tensor(rows, dtype=torch.int32, device=device)
    if layout == "strided":
        base = torch.full((full.shape[0], 2 * full.shape[1]), junk, dtype=torch.int32,
                          device=device)
        base[:, ::2] = full
        return base[:, ::2], base
    if layout == "expanded":
        base = full[:1].clone()
        return base.expand(full.shape), base
    if layout == "transposed":
        base = full.t().contiguous()
        return base.t(), base
    return full, full


def _caches(call: HazardCall, draw: HazardDraw, shape: tuple[int, ...],
            device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """k_cache and v_cache inside NaN-filled buffers with one guard entry (page) before and
    after them, where an index one past either end lands; or both in one buffer, K and V of an
    entry side by side (vLLM's layout)."""
    rows = shape[0]
    if draw.kv_one_buffer:
        buffer = torch.full((rows + 2, 2, *shape[1:]), GUARD_SENTINEL, dtype=draw.dtype,
                            device=device)
        parts = [(slice(1, rows + 1), 0), (slice(1, rows + 1), 1)]
        call.guards.append(("k_cache / v_cache buffer", buffer, parts, GUARD_SENTINEL))
        call.caches["k_cache / v_cache buffer"] = buffer
        k_cache, v_cache = buffer[parts[0]], buffer[parts[1]]
    else:
        views = []
        for name in ("k_cache", "v_cache"):
            view, buffer, index = guarded(shape, draw.dtype, device, GUARD_SENTINEL)
            call.guards.append((f"{name} buffer", buffer, index, GUARD_SENTINEL))
            call.caches[f"{name} buffer"] = buffer
            views.append(view)
        k_cache, v_cache = views
    for t in (k_cache, v_cache):
        t.copy_(torch.randn(shape, dtype=draw.dtype, device=device))
    return k_cache, v_cache


def build_hazard(draw: HazardDraw, device: Any = "cuda", api: Any = None) -> HazardCall:
    """The draw's tensors on ``device`` and its call of ``api`` (flash_hopper, or a stand-in
    with its entry points): inputs inside NaN-filled buffers, index tensors in their drawn
    layouts, out= a slice of a buffer of OUT_SENTINEL, the caches inside guarded buffers."""
    api = api if api is not None else flash_hopper
    sizes, values, dtype = draw.sizes, draw.values, draw.dtype
    heads_q, heads_kv, d = draw.heads_q, draw.heads_kv, draw.head_dim
    call = HazardCall(None, {})

    def data(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        view, buffer, _ = guarded(shape, dtype, device, GUARD_SENTINEL)
        view.copy_(torch.randn(shape, dtype=dtype, device=device))
        call.watched[name] = buffer
        return view

    def index(name: str) -> torch.Tensor:
        t, base = index_tensor(values[name], draw.layouts.get(name, "contiguous"), device,
                               draw.junk)
        call.watched[name] = base
        call.clean[name] = torch.tensor(values[name], dtype=torch.int32, device=device)
        return t

    q_shape = ((sizes["total_q"], heads_q, d) if sizes.get("packed_q")
               else (sizes["batch"], sizes["seqlen_q"], heads_q, d))
    q = data("q", q_shape)
    if draw.mask.get("softcap"):  # scores reach the cap, as FA3's tests
        q.mul_(draw.mask["softcap"] / 4)
    kw: dict[str, Any] = {"q": q}
    if draw.entry == "dense":
        kv_shape = (sizes["batch"], sizes["seqlen_k"], heads_kv, d)
        kw.update(k=data("k", kv_shape), v=data("v", kv_shape),
                  return_attn_probs=draw.want_lse)
        call.fn = api.flash_attn_func
    elif draw.entry == "varlen":
        kv_shape = (sizes["total_k"], heads_kv, d)
        kw.update(k=data("k", kv_shape), v=data("v", kv_shape),
                  cu_seqlens_q=index("cu_seqlens_q"), cu_seqlens_k=index("cu_seqlens_k"),
                  max_seqlen_q=values["max_seqlen_q"], max_seqlen_k=values["max_seqlen_k"],
                  return_attn_probs=draw.want_lse)
        if "seqused_k" in values:
            kw["seqused_k"] = index("seqused_k")
        call.fn = api.flash_attn_varlen_func
    else:
        paged = draw.entry == "paged"
        entries = ((sizes["num_pages"], sizes["page_size"]) if paged
                   else (sizes["batch_cache"], sizes["seqlen_cache"]))
        kw["k_cache"], kw["v_cache"] = _caches(call, draw, (*entries, heads_kv, d), device)
        if sizes["new"]:
            new_shape = (sizes["batch"], sizes["new"], heads_kv, d)
            kw.update(k=data("k", new_shape), v=data("v", new_shape))
        for name in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "cu_seqlens_q"):
            if name in values:
                kw[name] = index(name)
        if "cu_seqlens_q" in values:
            kw["max_seqlen_q"] = values["max_seqlen_q"]
        if paged:
            kw["page_table"], call.watched["page_table"] = table_tensor(
                values["page_table"], draw.layouts.get("page_table", "contiguous"), device,
                draw.junk)
            call.clean["page_table"] = torch.tensor(values["page_table"], dtype=torch.int32,
                                                    device=device)
        kw["return_softmax_lse"] = draw.want_lse
        call.fn = api.flash_attn_with_kvcache
    if draw.entry != "dense":
        heads_pad = 1 if draw.out_layout == "heads" else 0
        out, buffer, inside = guarded(q_shape, dtype, device, OUT_SENTINEL, draw.out_pad,
                                      heads_pad)
        call.guards.append(("out's buffer", buffer, inside, OUT_SENTINEL))
        kw["out"] = call.out = out
    kw.update(draw.mask)
    call.kwargs = kw
    return call


def kvcache_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k: torch.Tensor | None, v: torch.Tensor | None,
                      cache_seqlens: torch.Tensor, cache_batch_idx: torch.Tensor | None,
                      cache_leftpad: torch.Tensor | None, page_table: torch.Tensor | None,
                      cu_seqlens_q: torch.Tensor | None, mask: dict[str, Any],
                      upcast: bool = True) -> tuple[torch.Tensor, ...]:
    """attention_kvcache_ref for flash_attn_with_kvcache's whole signature: a page table whose
    rows cache_batch_idx picks, and packed queries (cu_seqlens_q: sequence by sequence, the
    caches carried from one to the next, lse (heads_q, total_q)). Returns (out, lse, k_cache',
    v_cache') in the call's layouts; valid values only."""
    if page_table is not None and cache_batch_idx is not None:
        page_table, cache_batch_idx = page_table[cache_batch_idx.long()], None
    if cu_seqlens_q is None:
        return reference.attention_kvcache_ref(
            q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, upcast=upcast, **mask)
    cu = cu_seqlens_q.tolist()
    if page_table is None and cache_batch_idx is None:
        # sequence by sequence below, each a batch of one: name its cache entry (b), or the
        # reference would read entry 0 for all of them
        cache_batch_idx = torch.arange(len(cu) - 1, dtype=torch.int32, device=q.device)
    dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    out = torch.zeros(*q.shape[:2], v_cache.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=dtype, device=q.device)
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        # a sequence without queries still appends its keys: one dummy row, its output dropped
        rows = q[None, q0:q1] if q1 > q0 else q.new_zeros(1, 1, *q.shape[1:])

        def one(t: torch.Tensor | None, b: int = b) -> torch.Tensor | None:
            return None if t is None else t[b:b + 1]

        o, l, k_cache, v_cache = reference.attention_kvcache_ref(
            rows, k_cache, v_cache, one(k), one(v), one(cache_seqlens), one(cache_batch_idx),
            one(cache_leftpad), one(page_table), upcast=upcast, **mask)
        if q1 > q0:
            out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse, k_cache, v_cache


def _covered_rows(cu: torch.Tensor) -> torch.Tensor:
    """The query rows some sequence of the (valid) offsets ``cu`` covers."""
    bounds = cu.tolist()
    parts = [torch.arange(a, b, device=cu.device) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=cu.device)


def hazard_reference(draw: HazardDraw, call: HazardCall) -> dict[str, torch.Tensor]:
    """A judged draw's references, computed before the call (it writes the caches): out and lse
    in float64, low (out in the input dtype: FA3's rule), k_cache / v_cache after the append."""
    kw, clean, mask = call.kwargs, call.clean, draw.mask
    refs: dict[str, torch.Tensor] = {}
    for upcast in (True, False):
        def t(name: str, upcast: bool = upcast) -> torch.Tensor | None:
            x = kw.get(name)
            return x.double() if upcast and x is not None else x

        if draw.entry == "dense":
            result = reference.attention_ref(t("q"), t("k"), t("v"), upcast=upcast, **mask)
        elif draw.entry == "varlen":
            result = reference.attention_varlen_ref(
                t("q"), t("k"), t("v"), clean["cu_seqlens_q"], clean["cu_seqlens_k"], None,
                clean.get("seqused_k"), upcast=upcast, **mask)
        else:
            result = kvcache_reference(
                t("q"), t("k_cache"), t("v_cache"), t("k"), t("v"), clean["cache_seqlens"],
                clean.get("cache_batch_idx"), clean.get("cache_leftpad"),
                clean.get("page_table"), clean.get("cu_seqlens_q"), mask, upcast)
        if upcast:
            refs.update(out=result[0], lse=result[1])
            if len(result) == 4:
                refs.update(k_cache=result[2], v_cache=result[3])
        else:
            refs["low"] = result[0]
    return refs


def _judge_hazard(draw: HazardDraw, call: HazardCall, refs: dict[str, torch.Tensor] | None,
                  result: Any) -> list[str]:
    """A call that returned: out= written in place, no NaN, refused if it had to be, and, for a
    judged draw, FA3's rule against the reference on the rows a sequence covers (rows outside
    every sequence of flash_attn_varlen_func keep what out= held), the caches the reference's."""
    out, lse = result if isinstance(result, tuple) else (result, None)
    problems = []
    if call.out is not None:
        if not isinstance(out, torch.Tensor) or out.data_ptr() != call.out.data_ptr():
            problems.append("out: the call returned another tensor than the out= it was given")
        out = call.out
    if not isinstance(out, torch.Tensor):
        return problems + [f"returned {type(out).__name__}, not a tensor"]
    # Packed queries ((total_q, heads, d), lse (heads, total_q)): rows outside every sequence are
    # never written, and lse's there are uninitialized; with bad offsets no row is known to be
    # a sequence's.
    rows, packed = None, "cu_seqlens_q" in call.clean
    if packed and not _offset_violations("cu_seqlens_q", draw.values["cu_seqlens_q"],
                                         draw.sizes["total_q"], draw.entry != "varlen"):
        rows = _covered_rows(call.clean["cu_seqlens_q"])
    if not isinstance(lse, torch.Tensor) or (packed and rows is None):
        lse_seen = None
    else:
        lse_seen = lse[:, rows] if packed else lse
    for name, got in (("out", out), ("lse", lse_seen)):
        if got is not None and got.isnan().any():
            problems.append(f"{name}: NaN (the inputs hold none)")
    # a call without query rows computes nothing: the library need not read its offsets
    if draw.checks and draw.violations and call.kwargs["q"].numel():
        problems.append(f"returned with the value checks on, though {'; '.join(draw.violations)}")
    if refs is None:
        return problems
    got = {"out": out}
    if draw.want_lse:
        if isinstance(lse, torch.Tensor):
            got["lse"] = lse
        else:
            problems.append("lse: not returned")
    want, low = {"out": refs["out"], "lse": refs["lse"]}, {"out": refs["low"]}
    if rows is not None:  # a judged draw's offsets are valid: its covered rows are known
        got = {name: (x[rows] if name == "out" else x[:, rows]) for name, x in got.items()}
        want = {"out": want["out"][rows], "lse": want["lse"][:, rows]}
        low = {"out": low["out"][rows]}
        if draw.entry == "varlen":
            kept = guard_check(out, rows, OUT_SENTINEL, "out rows outside every sequence")
            if kept:
                problems.append(kept)
    problems += judge(got, want, low, draw.mask.get("softcap", 0.0))
    for name in ("k_cache", "v_cache"):
        if name in refs and not torch.equal(call.kwargs[name], refs[name].to(draw.dtype)):
            problems.append(f"{name}: not the reference's after the append")
    return problems


def run_hazard(draw: HazardDraw, device: Any = "cuda",
               api: Any = None) -> tuple[list[str], dict[str, Any], bool]:
    """Builds the draw, calls it with the checks on or off (draw.checks), and judges it (the
    section comment). Returns (problems, facts for the report, fatal): fatal when the device faulted,
    which poisons the process's CUDA context (nothing after it proves anything)."""
    call = build_hazard(draw, device, api)
    refs = hazard_reference(draw, call) if draw.judged else None
    watched = {name: t.clone() for name, t in call.watched.items()}
    caches = {name: t.clone() for name, t in call.caches.items()}
    error, result = None, None
    with offset_checks(draw.checks):
        try:
            result = call.fn(**call.kwargs)
        except Exception as e:  # noqa: BLE001 - judged below
            error = e
    facts = {"result": "returned" if error is None else
             f"{type(error).__name__}: {str(error)[:160]}"}
    if torch.device(device).type == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a device fault: the finding
            return [f"device fault after the call ({facts['result']}): {e}"], facts, True
    problems = [problem for problem in (guard_check(buffer, inside, sentinel, name)
                                        for name, buffer, inside, sentinel in call.guards)
                if problem]
    changed = cache_unchanged(watched, call.watched)
    if changed:
        problems.append(f"inputs changed: {changed}")
    if error is None:
        return problems + _judge_hazard(draw, call, refs, result), facts, False
    refused = refusal_problem(error, call.kwargs)
    if refused:
        problems.append(refused)
    changed = cache_unchanged(caches, call.caches)
    if changed:
        problems.append(f"a refused call changed the cache: {changed}")
    return problems, facts, False


def hazard_outcome(draw: HazardDraw, device: Any = "cuda", api: Any = None) -> Outcome:
    """The draw run twice, the library's value checks on and then off (fresh tensors each
    time), each run's problems prefixed by which; a device fault ends it."""
    config, problems, fatal = draw.config(), [], False
    for checks in (True, False):
        run = dataclasses.replace(draw, checks=checks)
        found, facts, fatal = run_hazard(run, device, api)
        label = "checks on" if checks else "checks off"
        config[f"result ({label})"] = facts["result"]
        config[f"judged ({label})"] = run.judged
        problems += [f"{label}: {problem}" for problem in found]
        if fatal:
            break
    return Outcome("hazard", config, problems, 0.0, fatal)


def hazard_case(rng: random.Random, cap: Capability, small: bool) -> Outcome:
    """One serving-hazard draw on the GPU, with the value checks on and off (hazard_outcome)."""
    return hazard_outcome(draw_hazard(rng, cap, small), "cuda")


VALID = {
    "dense": lambda rng, cap, small: dense_case(rng, cap, small, "dense"),
    "qkvpacked": lambda rng, cap, small: dense_case(rng, cap, small, "qkvpacked"),
    "varlen": varlen_case,
    "kvcache": kvcache_case,
    "hazard": hazard_case,  # adversarial values: judged by memory safety first (see above)
}


# --- invalid cases -------------------------------------------------------------------------------


def _base(device: str, dtype: torch.dtype = torch.bfloat16):
    return {"q": torch.randn(2, 33, 4, 64, device=device).to(dtype),
            "k": torch.randn(2, 40, 2, 64, device=device).to(dtype),
            "v": torch.randn(2, 40, 2, 64, device=device).to(dtype)}


def setter(name: str, value: Any) -> Any:
    """A mutation of a kwargs dict: kwargs[name] = value (value(kwargs) when callable)."""
    def mutate(kw):
        kw[name] = value(kw) if callable(value) else value
    return mutate


def _mutations(device: str) -> list[tuple[str, str, Any]]:
    """(description, the argument the message must name, a function of a fresh valid
    flash_attn_func kwargs dict that breaks one argument)."""
    other = "cpu" if device != "cpu" else "meta"

    def make(kw, shape, strides=None, dtype=None):
        # fresh tensors, not views: FakeTensors of a "cuda" device cannot be indexed on a
        # CPU-only torch
        dtype = dtype or kw["q"].dtype
        if strides is None:
            return torch.zeros(shape, dtype=dtype, device=kw["q"].device)
        return torch.empty_strided(shape, strides, dtype=dtype, device=kw["q"].device)

    return [
        ("q float32", "q", setter("q", lambda kw: kw["q"].float())),
        ("k int32", "k", setter("k", lambda kw: kw["k"].to(torch.int32))),
        ("v fp16 with bf16 q", "v", setter("v", lambda kw: kw["v"].half())),
        ("q 3-D", "q", setter("q", lambda kw: make(kw, (33, 4, 64)))),
        ("k 5-D", "k", setter("k", lambda kw: make(kw, (1, 2, 40, 2, 64)))),
        ("head_dim 60", "q", lambda kw: kw.update(q=make(kw, (2, 33, 4, 60)),
                                                   k=make(kw, (2, 40, 2, 60)),
                                                   v=make(kw, (2, 40, 2, 60)))),
        ("head_dim 264", "q", lambda kw: kw.update(q=make(kw, (2, 33, 4, 264)),
                                                    k=make(kw, (2, 40, 2, 264)),
                                                    v=make(kw, (2, 40, 2, 264)))),
        ("k head_dim != q's", "k", setter("k", lambda kw: make(kw, (2, 40, 2, 32)))),
        ("heads_q % heads_kv", "k", setter("q", lambda kw: make(kw, (2, 33, 3, 64)))),
        ("k batch", "k", setter("k", lambda kw: make(kw, (1, 40, 2, 64)))),
        ("v seqlen != k's", "v", setter("v", lambda kw: make(kw, (2, 39, 2, 64)))),
        ("v heads != k's", "v", setter("v", lambda kw: make(kw, (2, 40, 1, 64)))),
        ("q last stride 2", "q", setter("q", lambda kw: make(
            kw, (2, 33, 4, 64), (33 * 4 * 128, 4 * 128, 128, 2)))),
        ("k stride not 16-byte", "k", setter("k", lambda kw: make(
            kw, (2, 40, 2, 64), (40 * 2 * 65, 2 * 65, 65, 1)))),
        (f"v on {other}", "v", setter("v", lambda kw: torch.zeros(2, 40, 2, 64, device=other,
                                                                  dtype=kw["q"].dtype))),
        ("window 3 values", "window_size", setter("window_size", (1, 2, 3))),
        ("window floats", "window_size", setter("window_size", (1.5, 0))),
        ("window string", "window_size", setter("window_size", "left")),
        ("causal 1", "causal", setter("causal", 1)),
        ("softcap string", "softcap", setter("softcap", "x")),
        ("softcap inf", "softcap", setter("softcap", math.inf)),
        ("softmax_scale nan", "softmax_scale", setter("softmax_scale", math.nan)),
        ("softmax_scale 0", "softmax_scale", setter("softmax_scale", 0.0)),
        ("softmax_scale tensor", "softmax_scale", setter("softmax_scale",
                                                         lambda kw: torch.ones(3))),
        ("deterministic 'yes'", "deterministic", setter("deterministic", "yes")),
        ("return_attn_probs 2", "return_attn_probs", setter("return_attn_probs", 2)),
        ("backend 'fa9'", "backend", setter("backend", "fa9")),
        ("num_splits -1", "num_splits", setter("num_splits", -1)),
        ("sm_margin -3", "sm_margin", setter("sm_margin", -3)),
        ("pack_gqa 'x'", "pack_gqa", setter("pack_gqa", "x")),
        ("attention_chunk 1.5", "attention_chunk", setter("attention_chunk", 1.5)),
        ("attention_chunk -2", "attention_chunk", setter("attention_chunk", -2)),
        ("qv float32", "qv", setter("qv", lambda kw: kw["q"].float())),
        ("q None", "q", setter("q", None)),
        ("k a list", "k", setter("k", [[1.0]])),
    ]


def _varlen_mutations(device: str) -> list[tuple[str, str, Any]]:
    def cu(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return [
        ("cu_seqlens_q int64", "cu_seqlens_q", setter("cu_seqlens_q", lambda kw: cu(
            [0, 10, 33]).long())),
        ("cu_seqlens_k 2-D", "cu_seqlens_k", setter("cu_seqlens_k", lambda kw: cu(
            [[0, 10, 40]]))),
        ("cu_seqlens_k length != cu_seqlens_q's", "cu_seqlens_k",
         setter("cu_seqlens_k", lambda kw: cu([0, 40]))),
        ("cu_seqlens_q a list", "cu_seqlens_q", setter("cu_seqlens_q", [0, 10, 33])),
        ("max_seqlen_q string", "max_seqlen_q", setter("max_seqlen_q", "big")),
        ("seqused_k float", "seqused_k", setter("seqused_k", lambda kw: torch.ones(
            2, device=device))),
        ("seqused_q wrong length", "seqused_q", setter("seqused_q", lambda kw: cu([1, 2, 3]))),
        ("q 4-D", "q", setter("q", lambda kw: torch.zeros(1, 33, 4, 64, dtype=kw["q"].dtype,
                                                         device=device))),
    ]


def invalid_calls(device: str) -> list[tuple[str, str, Any]]:
    """(description, argument, call) for every mutation on every API it applies to."""
    calls = []
    for desc, arg, mutate in _mutations(device):
        def dense(mutate=mutate):
            kw = _base(device)
            mutate(kw)
            return flash_hopper.flash_attn_func(**kw)
        calls.append((f"flash_attn_func: {desc}", arg, dense))
    for desc, arg, mutate in _varlen_mutations(device):
        def varlen(mutate=mutate):
            kw = {"q": torch.randn(33, 4, 64, device=device).to(torch.bfloat16),
                  "k": torch.randn(40, 2, 64, device=device).to(torch.bfloat16),
                  "v": torch.randn(40, 2, 64, device=device).to(torch.bfloat16)}
            kw.update(cu_seqlens_q=torch.tensor([0, 10, 33], dtype=torch.int32, device=device),
                      cu_seqlens_k=torch.tensor([0, 10, 40], dtype=torch.int32, device=device),
                      max_seqlen_q=23, max_seqlen_k=30)
            mutate(kw)
            return flash_hopper.flash_attn_varlen_func(**kw)
        calls.append((f"flash_attn_varlen_func: {desc}", arg, varlen))
    packed = [
        ("qkv 6-D", "qkv", lambda: torch.zeros(1, 2, 8, 3, 2, 64, dtype=torch.bfloat16,
                                               device=device), None),
        ("qkv 4-D without num_heads_q", "num_heads_q",
         lambda: torch.zeros(2, 8, 6, 64, dtype=torch.bfloat16, device=device), None),
        ("qkv 4-D num_heads_q odd remainder", "num_heads_q",
         lambda: torch.zeros(2, 8, 6, 64, dtype=torch.bfloat16, device=device), 3),
        ("qkv 5-D third dim 2", "qkv",
         lambda: torch.zeros(2, 8, 2, 4, 64, dtype=torch.bfloat16, device=device), None),
        ("qkv float32", "q", lambda: torch.zeros(2, 8, 3, 4, 64, device=device), None),
    ]
    for desc, arg, make, heads in packed:
        def qkvpacked(make=make, heads=heads):
            return flash_hopper.flash_attn_qkvpacked_func(make(), num_heads_q=heads)
        calls.append((f"flash_attn_qkvpacked_func: {desc}", arg, qkvpacked))
    return calls


BAD_VALUES = (None, "x", 1.5, True, -5, 2**70, [], (1,), object(), math.nan)


def _type_fuzz_bases(device: str) -> dict[str, tuple[Any, dict[str, Any]]]:
    bf = torch.bfloat16

    def rand(*shape, dtype=bf):
        return torch.randn(*shape, device=device).to(dtype)

    k = rand(2, 40, 2, 64)
    kc = rand(2, 100, 2, 64)
    offsets = torch.tensor([0, 10, 33], dtype=torch.int32, device=device)
    return {
        "flash_attn_func": (flash_hopper.flash_attn_func, {"q": rand(2, 33, 4, 64), "k": k,
                                                           "v": k.clone()}),
        "flash_attn_qkvpacked_func": (flash_hopper.flash_attn_qkvpacked_func,
                                      {"qkv": rand(2, 33, 3, 4, 64)}),
        "flash_attn_varlen_func": (flash_hopper.flash_attn_varlen_func, {
            "q": rand(33, 4, 64), "k": rand(33, 2, 64), "v": rand(33, 2, 64),
            "cu_seqlens_q": offsets, "cu_seqlens_k": offsets.clone(), "max_seqlen_q": 23,
            "max_seqlen_k": 23}),
        "flash_attn_with_kvcache": (flash_hopper.flash_attn_with_kvcache, {
            "q": rand(2, 1, 4, 64), "k_cache": kc, "v_cache": kc.clone(),
            "cache_seqlens": torch.tensor([5, 60], dtype=torch.int32, device=device)}),
        "flash_attn_combine": (flash_hopper.flash_attn_combine, {
            "out_partial": rand(3, 2, 33, 4, 64, dtype=torch.float32),
            "lse_partial": rand(3, 2, 33, 4, dtype=torch.float32)}),
    }


def type_fuzz(device: str) -> list[str]:
    """Every parameter of every entry point given each of BAD_VALUES in turn (the others valid):
    the call may run (a value that is valid there, e.g. None for an optional tensor) or raise
    TypeError / ValueError / NotImplementedError naming that parameter; anything else (an
    AttributeError, a torch RuntimeError, a schema overflow) is a finding. ``device`` "fake":
    FakeTensors of a "cuda" device, where calls that pass validation stop at the device query
    (DeviceQueryError / LibraryNotFoundError: not findings)."""
    fake = device == "fake"
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode()
    else:
        import contextlib

        mode = contextlib.nullcontext()
    reached = (flash_hopper.DeviceQueryError, flash_hopper.LibraryNotFoundError) if fake else ()
    problems = []
    with mode:
        for name, (fn, base) in _type_fuzz_bases("cuda").items():
            for param in inspect.signature(fn).parameters:
                for bad in BAD_VALUES:
                    kwargs = {key: (t.clone() if isinstance(t, torch.Tensor) else t)
                              for key, t in base.items()}
                    kwargs[param] = bad
                    try:
                        fn(**kwargs)
                    except ALLOWED as e:
                        if param not in str(e) and "must be a CUDA" not in str(e):
                            problems.append(f"{name}({param}={bad!r:.20}): {type(e).__name__} "
                                            f"does not name {param!r}: {str(e)[:160]}")
                    except reached:
                        pass
                    except Exception as e:  # noqa: BLE001 - the finding
                        problems.append(f"{name}({param}={bad!r:.20}): {type(e).__name__}: "
                                        f"{str(e)[:200]}")
                    if not fake:
                        torch.cuda.synchronize()
    return problems


def check_invalid(desc: str, arg: str, call: Any) -> str | None:
    """None when call raises an allowed exception naming ``arg``; else what went wrong."""
    try:
        call()
    except ALLOWED as e:
        message = str(e)
        if arg not in message:
            return f"{desc}: {type(e).__name__} does not name {arg!r}: {message}"
        return None
    except Exception as e:  # noqa: BLE001 - any other exception is the finding
        return f"{desc}: {type(e).__name__} (expected TypeError / ValueError / " \
               f"NotImplementedError naming {arg!r}): {e}"
    return f"{desc}: no error"


# --- the driver ----------------------------------------------------------------------------------


def run_valid(seconds: float, seed: int, small: bool, kinds: list[str] | None = None,
              max_cases: int | None = None) -> list[Outcome]:
    cap = Capability.detect()
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    names = kinds or list(VALID)
    end = time.monotonic() + seconds
    while time.monotonic() < end and (max_cases is None or len(outcomes) < max_cases):
        kind = rng.choice(names)
        case_seed = rng.randrange(1 << 30)
        torch.manual_seed(case_seed)
        start = time.monotonic()
        try:
            outcome = VALID[kind](random.Random(case_seed), cap, small)
        except Exception as e:  # noqa: BLE001 - a valid call must not raise
            outcome = Outcome(kind, {"seed": case_seed}, [
                f"raised {type(e).__name__}: {e}",
                traceback.format_exc(limit=4)], 0.0)
        outcome.config["seed"] = case_seed
        outcome.seconds = round(time.monotonic() - start, 3)
        if not outcome.fatal:
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a device fault is the finding
                outcome.problems.append(f"device fault: {e}")
                outcome.fatal = True
        outcomes.append(outcome)
        if outcome.fatal:  # the CUDA context is poisoned: later cases would prove nothing
            break
    return outcomes


def run_invalid(device: str) -> list[str]:
    """The invalid calls on real tensors of ``device`` ("cuda"), or with device "fake" on
    FakeTensors of a "cuda" device (no GPU needed: the metadata-only path torch.compile traces,
    where every check but the offsets' values runs)."""
    problems = []
    fake = device == "fake"
    for desc, arg, call in invalid_calls("cuda" if fake else device):
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode():
                problem = check_invalid(desc, arg, call)
        else:
            problem = check_invalid(desc, arg, call)
        if problem:
            problems.append(problem)
        if device == "cuda":
            torch.cuda.synchronize()  # a launch with bad input would surface here
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help="short sequences (sanitizer runs)")
    parser.add_argument("--kinds", nargs="*", choices=list(VALID),
                        help="random cases of these kinds only (default: all of them in turn; "
                             "hazard: the serving-hazard calls)")
    parser.add_argument("--invalid-only", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--replay", nargs="*", default=[], metavar="KIND:SEED",
                        help="run these valid cases only (their seeds from an earlier report)")
    parser.add_argument("--ulp-floor", type=float, default=ULP_FLOOR)
    args = parser.parse_args(argv)
    globals()["ULP_FLOOR"] = args.ulp_floor
    if args.replay:
        cap = Capability.detect()
        for item in args.replay:
            kind, seed = item.split(":")
            torch.manual_seed(int(seed))
            outcome = VALID[kind](random.Random(int(seed)), cap, args.small)
            print(kind, seed, outcome.config, outcome.problems or "pass")
        return 0
    device = "cuda" if torch.cuda.is_available() else "fake"
    invalid = run_invalid(device) + type_fuzz(device)
    outcomes = [] if args.invalid_only or device == "fake" else run_valid(
        args.seconds, args.seed, args.small, args.kinds)
    failed = [o for o in outcomes if o.problems]
    summary = {
        "seed": args.seed, "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "valid_cases": len(outcomes), "valid_failed": len(failed),
        "device_fault": any(o.fatal for o in outcomes),
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in VALID},
        "invalid_calls": len(invalid_calls("cuda")), "invalid_failed": len(invalid),
        "invalid_problems": invalid,
        "failures": [{"kind": o.kind, "config": o.config, "problems": o.problems}
                     for o in failed],
    }
    text = json.dumps(summary, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, default=str))
    for o in failed[:20]:
        print("FAIL", o.kind, o.config, o.problems[:2])
    return 1 if failed or invalid else 0


if __name__ == "__main__":
    sys.exit(main())
