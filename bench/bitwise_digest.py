"""Digests of the public API's outputs over a fixed set of cases, to compare two builds bitwise.

    FLASH_HOPPER_LIB=old.so PYTHONPATH=old/python python bench/bitwise_digest.py --json a.json
    FLASH_HOPPER_LIB=new.so PYTHONPATH=python     python bench/bitwise_digest.py --json b.json
    python bench/bitwise_digest.py --compare a.json b.json

Two builds of different ABIs cannot share a process, so each run writes the SHA-256 of every
output (forward out / LSE, backward dq / dk / dv, with_kvcache out and the caches after the
append) per case, and --compare lists the cases whose digests differ. The inputs are drawn from a
seeded generator on the GPU, so both runs see the same bytes; the kernel path each case took
(which_backend) is recorded beside it, so a difference from a changed route is told from one
from a changed kernel. Exit status of --compare: 1 when any digest of a case both runs served
differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any


def _digest(t: Any) -> str:
    import torch

    t = t.detach().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return hashlib.sha256(raw.cpu().numpy().tobytes()).hexdigest()[:24]


def _cases() -> list[dict[str, Any]]:
    cases = []
    for dtype in ("bf16", "fp16"):
        for d in (64, 128, 256):
            for causal in (False, True):
                cases.append({"kind": "fwd_bwd", "dtype": dtype, "d": d, "causal": causal,
                              "s": 1000, "h": 4, "h_kv": 2})
    for d in (64, 128):
        cases.append({"kind": "fwd_bwd", "dtype": "bf16", "d": d, "causal": False, "s": 777,
                      "h": 4, "h_kv": 4, "window": (128, 64)})
        cases.append({"kind": "fwd_bwd", "dtype": "bf16", "d": d, "causal": True, "s": 640,
                      "h": 4, "h_kv": 1, "softcap": 30.0})
    for d in (64, 128, 256):
        cases.append({"kind": "fp8", "d": d, "causal": False, "s": 1000, "h": 4, "h_kv": 2})
        cases.append({"kind": "fp8", "d": d, "causal": True, "s": 1000, "h": 4, "h_kv": 2})
    for d in (64, 128):
        cases.append({"kind": "varlen", "dtype": "bf16", "d": d, "causal": True})
        cases.append({"kind": "kvcache", "dtype": "bf16", "d": d, "paged": False, "seqlen_q": 1})
        cases.append({"kind": "kvcache", "dtype": "bf16", "d": d, "paged": True, "seqlen_q": 4})
    return cases


def _run_case(fh: Any, c: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(c.get("dtype", "bf16"))

    def rand(*shape: int, dtype: Any = dt) -> Any:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    out: dict[str, Any] = {}
    d = c["d"]
    if c["kind"] in ("fwd_bwd", "fp8"):
        b, s, h, hk = 2, c["s"], c["h"], c["h_kv"]
        q, k, v = rand(b, s, h, d), rand(b, s, hk, d), rand(b, s, hk, d)
        kw: dict[str, Any] = {"causal": c["causal"]}
        if "window" in c:
            kw["window_size"] = c["window"]
        if "softcap" in c:
            kw["softcap"] = c["softcap"]
        if c["kind"] == "fp8":
            e4m3 = torch.float8_e4m3fn
            descale = [torch.rand(b, hk, generator=gen, device="cuda") + 0.5 for _ in range(3)]
            q8, k8, v8 = q.to(e4m3), k.to(e4m3), v.to(e4m3)
            out["backend"] = fh.which_backend(q8, k8, v8, **kw)[0]
            o, lse = fh.flash_attn_func(q8, k8, v8, q_descale=descale[0], k_descale=descale[1],
                                        v_descale=descale[2], return_attn_probs=True, **kw)[:2]
            out.update(out=_digest(o), lse=_digest(lse))
            return out
        out["backend"] = fh.which_backend(q, k, v, **kw)[0]
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        o, lse = fh.flash_attn_func(q, k, v, return_attn_probs=True, **kw)[:2]
        out.update(out=_digest(o), lse=_digest(lse))
        grad = rand(*o.shape)
        try:  # a forward-only build: the forward's digests still count
            o.backward(grad)
        except Exception as e:  # noqa: BLE001
            out["bwd_error"] = f"{type(e).__name__}: {e}"[:200]
            return out
        out.update(dq=_digest(q.grad), dk=_digest(k.grad), dv=_digest(v.grad))
        return out
    if c["kind"] == "varlen":
        lens = [37, 300, 1, 512]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                          device="cuda")
        total = sum(lens)
        q, k, v = rand(total, 4, d), rand(total, 2, d), rand(total, 2, d)
        o = fh.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=c["causal"])
        o = o[0] if isinstance(o, tuple) else o
        out.update(out=_digest(o))
        return out
    # with_kvcache: append new keys, attend (the caches' bytes after the append are digested too)
    b, hk, h, sq = 3, 2, 8, c["seqlen_q"]
    q = rand(b, sq, h, d)
    k_new, v_new = rand(b, sq, hk, d), rand(b, sq, hk, d)
    seqlens = torch.tensor([100, 513, 7], dtype=torch.int32, device="cuda")
    if c["paged"]:
        page, pages_per = 64, 16
        kc, vc = rand(b * pages_per, page, hk, d), rand(b * pages_per, page, hk, d)
        table = torch.randperm(b * pages_per, generator=gen, device="cuda").to(torch.int32)
        table = table.view(b, pages_per)
        o = fh.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                       page_table=table, causal=True)
    else:
        kc, vc = rand(b, 1024, hk, d), rand(b, 1024, hk, d)
        o = fh.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                       causal=True)
    o = o[0] if isinstance(o, tuple) else o
    out.update(out=_digest(o), k_cache=_digest(kc), v_cache=_digest(vc))
    return out


def run(path: str) -> int:
    import flash_hopper as fh
    import torch

    results = []
    for i, c in enumerate(_cases()):
        try:
            r = _run_case(fh, c, seed=1000 + i)
        except Exception as e:  # noqa: BLE001 - a refused case is recorded, not fatal
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        results.append({"case": c, **r})
    torch.cuda.synchronize()
    info = fh.build_info() if hasattr(fh, "build_info") else {}
    with open(path, "w") as f:
        json.dump({"build": {k: info.get(k) for k in ("version", "commit", "cuda")},
                   "gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)
    errors = sum("error" in r for r in results)
    print(f"{len(results)} cases, {errors} refused or failed -> {path}")
    return 0


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as fa, open(b_path) as fb:
        a, b = json.load(fa)["results"], json.load(fb)["results"]
    differ = 0
    for ra, rb in zip(a, b):
        name = json.dumps(ra["case"], sort_keys=True)
        if "error" in ra or "error" in rb:
            print(f"skipped (not served by both): {name}: {ra.get('error')} | {rb.get('error')}")
            continue
        keys = [k for k in ra if k in rb and k not in ("case", "backend", "bwd_error")]
        bad = [k for k in keys if ra[k] != rb[k]]
        ba, bb = ra.get("backend"), rb.get("backend")
        route = "" if ba == bb else f" route {ba} -> {bb}"
        if bad:
            differ += 1
            print(f"DIFFERS {bad}{route}: {name}")
        else:
            print(f"identical {sorted(keys)}{route}: {name}")
    print(f"{differ} of {len(a)} cases differ")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write this run's digests here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.json:
        ap.error("--json or --compare")
    return run(args.json)


if __name__ == "__main__":
    sys.exit(main())
