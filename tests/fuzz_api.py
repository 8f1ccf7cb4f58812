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

    python tests/fuzz_api.py --seconds 120 --seed 1 --out fuzz.json [--invalid-only] [--small]

tests/test_fuzz.py runs a fixed-seed slice of both on CPU (invalid) and GPU (valid).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
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


VALID = {
    "dense": lambda rng, cap, small: dense_case(rng, cap, small, "dense"),
    "qkvpacked": lambda rng, cap, small: dense_case(rng, cap, small, "qkvpacked"),
    "varlen": varlen_case,
    "kvcache": kvcache_case,
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
        ("qv given", "qv", setter("qv", lambda kw: kw["q"])),
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
        torch.cuda.synchronize()
        outcomes.append(outcome)
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
    parser.add_argument("--kinds", nargs="*", choices=list(VALID))
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
