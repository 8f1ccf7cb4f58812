"""Per-iteration SASS counts of an attention forward kernel's hot loops, for comparing two builds.

    python bench/sass_compare.py BINARY --kernel REGEX --block-n N [--json OUT]
    python bench/sass_compare.py --case LABEL BINARY REGEX BLOCK_N [--case ...] \
        [--json OUT] [--markdown OUT.md]

BINARY is a .so / .o / .cubin (read with `cuobjdump -sass -fun`, one kernel at a time: a 100 MB
library holds ~1000 kernels and dumping them all takes minutes; cuobjdump must be on PATH) or a
text file that already holds `cuobjdump -sass` / `nvdisasm` output. REGEX is matched against the mangled and the demangled
names; it must select exactly one kernel. BLOCK_N (the kernel's keys per KV block) tells the QK
GEMM from the PV GEMM and normalizes the counts to 128 keys. LABEL is `side:case` (ours:bf16-d128,
fa3:bf16-d128): the markdown puts the sides of one case next to each other.

What is counted, per consumer thread (a SASS instruction is issued once per warp and counts once
per thread here):
  * The consumer loop: the innermost loop (natural loop of a back edge whose target dominates its
    source) that holds a QK WGMMA, a PV WGMMA and a MUFU.EX2. Kernels with run-time flags (ours:
    masked / unmasked steps, softcap, the lazy O rescale, FP8's single-level ablation) have several
    paths through it; the path counted is the longest one from the loop header to a back edge that
    holds both GEMMs and an exponential and no instruction matching --avoid (softcap's tanh, the
    mask's selects, the epilogue's reciprocal): the unmasked, uncapped step with every optional
    operation executed (--shortest counts the shortest one instead). Inner loops count once;
    out-of-line code that jumps back into the loop (mbarrier retries) is never on the path.
    Forward branches the path jumps over are listed with what they skip (`skipped`): read them
    before trusting a count.
  * WGMMA roles: an RS WGMMA (A from registers) is the PV GEMM; an SS one is the QK GEMM when its
    N equals BLOCK_N, else the PV GEMM (P through shared memory). Groups end at the WGMMA carrying
    `gsb0`; `WARPGROUP.DEPBAR.LE gsb0, k` waits until at most k groups are in flight, so the PV
    GEMM's wait is the first DEPBAR after the PV group with at least k groups issued after it.
  * The V transposer (FP8): the innermost loop holding LDSM (transposing), STSM and an mbarrier
    operation (SYNCS) is the per-V-tile loop, counted on its shortest path (a warp that only
    transposes); a loop inside it (a unit of 32 keys x 16 columns per trip) is reported per trip
    as well. Where each transposer warp runs a copy of its own (ours: straight-line code with
    each warp's units fixed at compile time), every copy's per-V-tile loop is counted too
    (`per_copy`, by address), and their sum is the transposer's per V tile.

Static counts only: no latencies, no stalls, no bank conflicts, no trip counts of loops the
compiler did not unroll, and a path is not a profile (bench/PERFLOG.md holds the measurements).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

KEYS_PER_ROW = 128  # the normalization: counts per 128 keys of one consumer thread's rows

_FUNC_RE = re.compile(r"^\s*(?:\.text\.)?Function\s*:\s*(\S+)")
_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
_INSTR_RE = re.compile(
    r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(?:\{\s*)?(@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_HEX_RE = re.compile(r"0x[0-9a-fA-F]+")
_LABEL_REF_RE = re.compile(r"`\((\.L_\w+)\)")
_WGMMA_RE = re.compile(r"^(HGMMA|QGMMA|IGMMA|BGMMA)\.(\d+)x(\d+)x(\d+)")
_DEPBAR_RE = re.compile(r"gsb0\s*,\s*(0x[0-9a-fA-F]+|\d+)")
# `PRMT Rd, Ra, 0x654, Rs`: a shared-memory address put into the cluster window (mbarrier
# arrivals; Ra = RZ, or the peer CTA's rank with multicast), not data.
_PRMT_ADDR_RE = re.compile(r",\s*0x654\s*,")


@dataclass
class Instr:
    addr: int
    guard: str  # "" or "@P0", "@!UP1", ...
    opcode: str  # HGMMA.64x176x16.F32.BF16
    operands: str
    target: int | None = None  # branch target address

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def text(self) -> str:
        return f"{self.guard}{self.opcode} {self.operands}".strip()


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Instructions per function of `cuobjdump -sass` / `nvdisasm` text (hex or label targets)."""
    funcs: dict[str, list[Instr]] = {}
    labels: dict[str, dict[str, int]] = {}
    pending: list[str] = []
    name = None
    for line in text.splitlines():
        m = _FUNC_RE.match(line)
        if m:
            name = m.group(1)
            funcs[name] = []
            labels[name] = {}
            pending = []
            continue
        if name is None:
            continue
        m = _LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        for label in pending:
            labels[name][label] = addr
        pending = []
        guard = (m.group(2) or "").strip()
        ins = Instr(addr, guard + " " if guard else "", m.group(3), m.group(4).strip())
        funcs[name].append(ins)
    for fname, ins_list in funcs.items():
        for ins in ins_list:
            if ins.base not in ("BRA", "BRX", "JMP", "CALL"):
                continue
            ref = _LABEL_REF_RE.search(ins.operands)
            if ref and ref.group(1) in labels[fname]:
                ins.target = labels[fname][ref.group(1)]
            else:
                hexes = _HEX_RE.findall(ins.operands)
                if hexes and ins.base in ("BRA", "JMP"):
                    ins.target = int(hexes[-1], 16)
    return funcs


def _unconditional(ins: Instr) -> bool:
    """True when control never falls through: an unguarded BRA / EXIT / RET without a predicate
    or divergence operand."""
    if ins.guard and not ins.guard.strip().endswith("PT"):
        return False
    if ins.base in ("EXIT", "RET", "JMP", "BRX"):
        return True
    if ins.base == "BRA":
        # `BRA.DIV UR8, t` and `BRA P2, t` branch on a condition; `BRA.U.ANY` too.
        return "." not in ins.opcode and not re.match(r"\s*!?U?P\d", ins.operands)
    return False


@dataclass
class Block:
    start: int  # index of the first instruction
    end: int  # one past the last
    succs: list[int] = field(default_factory=list)  # block indices
    preds: list[int] = field(default_factory=list)


class Cfg:
    """Basic blocks, dominators and natural loops of one function."""

    def __init__(self, instrs: list[Instr]):
        self.instrs = instrs
        index = {ins.addr: i for i, ins in enumerate(instrs)}
        leaders = {0}
        for i, ins in enumerate(instrs):
            if ins.target is not None and ins.target in index:
                leaders.add(index[ins.target])
            if ins.base in ("BRA", "BRX", "JMP", "EXIT", "RET") and i + 1 < len(instrs):
                leaders.add(i + 1)
        starts = sorted(leaders)
        self.blocks = [Block(s, e) for s, e in zip(starts, starts[1:] + [len(instrs)])]
        self.block_of = {}
        for b, blk in enumerate(self.blocks):
            for i in range(blk.start, blk.end):
                self.block_of[i] = b
        for b, blk in enumerate(self.blocks):
            last = instrs[blk.end - 1]
            if last.target is not None and last.target in index:
                blk.succs.append(self.block_of[index[last.target]])
            if not _unconditional(last) and b + 1 < len(self.blocks):
                blk.succs.append(b + 1)
            blk.succs = list(dict.fromkeys(blk.succs))
            for s in blk.succs:
                self.blocks[s].preds.append(b)
        self.dom = self._dominators()
        self.back_edges = [(b, s) for b, blk in enumerate(self.blocks) for s in blk.succs
                           if s in self.dom[b]]

    def _dominators(self) -> list[set[int]]:
        n = len(self.blocks)
        order = self._reverse_postorder()
        reach = set(order)
        dom: list[set[int]] = [set(range(n)) for _ in range(n)]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for b in order[1:]:
                preds = [p for p in self.blocks[b].preds if p in reach]
                new = set.intersection(*(dom[p] for p in preds)) if preds else set()
                new = new | {b}
                if new != dom[b]:
                    dom[b] = new
                    changed = True
        return dom

    def _reverse_postorder(self) -> list[int]:
        seen, post = {0}, []
        stack = [(0, iter(self.blocks[0].succs))]
        while stack:
            b, it = stack[-1]
            nxt = next((s for s in it if s not in seen), None)
            if nxt is None:
                post.append(b)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(self.blocks[nxt].succs)))
        return post[::-1]

    def loops(self) -> dict[int, set[int]]:
        """header block -> natural loop (the union over its back edges)."""
        out: dict[int, set[int]] = {}
        for src, head in self.back_edges:
            body = out.setdefault(head, {head})
            work = [src]
            while work:
                b = work.pop()
                if b in body:
                    continue
                body.add(b)
                work.extend(self.blocks[b].preds)
        return out

    def block_instrs(self, b: int) -> list[Instr]:
        blk = self.blocks[b]
        return self.instrs[blk.start:blk.end]


# ---------------------------------------------------------------------------------------------
# WGMMA roles and the path through a loop
# ---------------------------------------------------------------------------------------------

def wgmma_shape(ins: Instr) -> tuple[int, int, int] | None:
    m = _WGMMA_RE.match(ins.opcode)
    return (int(m.group(2)), int(m.group(3)), int(m.group(4))) if m else None


def wgmma_role(ins: Instr, block_n: int) -> str | None:
    """'qk' or 'pv' for a WGMMA, None for anything else."""
    shape = wgmma_shape(ins)
    if shape is None:
        return None
    a_operand = ins.operands.split(",")[1].strip() if "," in ins.operands else ""
    if re.match(r"R\d+", a_operand):  # RS: P from registers
        return "pv"
    return "qk" if shape[1] == block_n else "pv"


def _features(instrs: list[Instr], wanted: dict[str, object]) -> int:
    mask = 0
    for bit, test in enumerate(wanted.values()):
        if any(test(ins) for ins in instrs):
            mask |= 1 << bit
    return mask


# The code a hot-loop path must not contain: softcap (tanh), masking (selects) and the epilogue's
# O / l (reciprocal). Ours compiles them into the loop behind run-time branches.
DEFAULT_AVOID = r"^(MUFU\.TANH|MUFU\.RCP|FSEL)"


def best_path(cfg: Cfg, body: set[int], head: int, wanted: dict[str, object],
              avoid: str = DEFAULT_AVOID, longest: bool = True) -> list[int]:
    """Blocks of the longest (or shortest) path, in instructions, from `head` to the source of a
    back edge to `head` that holds every feature in `wanted` (name -> predicate on an Instr) and
    no instruction matching `avoid`. Longest: every optional operation of the step runs (an O
    rescale behind a run-time test, a second try of an mbarrier wait). Inner loops are taken once
    (their back edges are dropped) and out-of-line code that jumps back (mbarrier retry loops) is
    a dead end; blocks are visited in address order, a topological order once back edges are
    gone."""
    full = (1 << len(wanted)) - 1
    rx = re.compile(avoid) if avoid else None
    latches = {src for src, h in cfg.back_edges if h == head and src in body}
    allowed = {b for b in body if b == head or rx is None
               or not any(rx.search(i.opcode) for i in cfg.block_instrs(b))}
    feats = {b: _features(cfg.block_instrs(b), wanted) for b in allowed}
    size = {b: cfg.blocks[b].end - cfg.blocks[b].start for b in allowed}
    better = (lambda a, b: a > b) if longest else (lambda a, b: a < b)
    # best[b][mask] = (instructions from the header through b, (previous block, its mask))
    best: dict[int, dict[int, tuple[int, tuple[int, int] | None]]] = {
        head: {feats[head]: (size[head], None)}}
    done = None
    for b in sorted(allowed):
        for mask, (cost, _) in best.get(b, {}).items():
            if b in latches and mask == full and (done is None or better(cost, done[0])):
                done = (cost, b, mask)
            for s in cfg.blocks[b].succs:
                if s not in allowed or s == head or s <= b:
                    continue
                m2 = mask | feats[s]
                prev = best.setdefault(s, {}).get(m2)
                if prev is None or better(cost + size[s], prev[0]):
                    best[s][m2] = (cost + size[s], (b, mask))
    if done is None:
        return []
    path, key = [], (done[1], done[2])
    while key is not None:
        path.append(key[0])
        key = best[key[0]][key[1]][1]
    return path[::-1]


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------

def _is_ex2(ins: Instr) -> bool:
    return ins.opcode.startswith("MUFU.EX2")


def _is_ldsm_t(ins: Instr) -> bool:
    return ins.base == "LDSM" and (".MT" in ins.opcode or ".T" in ins.opcode)


def count_ops(instrs: list[Instr], block_n: int) -> dict:
    """The counted rows of one instruction sequence."""
    c: Counter = Counter()
    wgmma: Counter = Counter()
    waited: set[str] = set()  # mbarriers waited on (a retry re-reads the same one)
    for ins in instrs:
        c["total"] += 1
        op = ins.opcode
        role = wgmma_role(ins, block_n)
        if role:
            form = "RS" if re.match(r"\s*R\d+", ins.operands.split(",")[1]) else "SS"
            shape = "x".join(map(str, wgmma_shape(ins)))
            wgmma[f"{ins.base}.{shape} {role.upper()} {form}"] += 1
            c[f"wgmma_{role}"] += 1
            continue
        base = ins.base
        if base == "NOP":
            c["NOP"] += 1
        elif base == "MUFU":
            c["MUFU.EX2" if _is_ex2(ins) else "MUFU other"] += 1
        elif base in ("FMNMX", "SHFL", "FADD", "FMUL", "FFMA", "F2FP", "LDSM", "STSM", "BAR",
                      "FSEL", "FSETP", "LDS", "STS"):
            c[base] += 1
        elif base == "PRMT":
            c["PRMT"] += 1
            if not _PRMT_ADDR_RE.search(ins.operands):
                c["PRMT data"] += 1
        elif base == "SYNCS":
            c["SYNCS"] += 1
            if "WAIT" in op:
                c["SYNCS wait instructions"] += 1
                waited.add(re.sub(r"\s+", "", ins.operands.split("]")[0]))
            else:
                c["SYNCS arrive"] += 1
        elif op.startswith("WARPGROUP.DEPBAR"):
            c["WARPGROUP.DEPBAR"] += 1
        elif op.startswith("WARPGROUP.ARRIVE"):
            c["WARPGROUP.ARRIVE"] += 1
        elif base in ("IMAD", "IADD3", "VIADD", "LEA", "SHF", "LOP3", "ISETP", "SEL", "MOV",
                      "IABS", "IMNMX"):
            c["integer"] += 1
        elif base.startswith("U"):
            c["uniform"] += 1
        if base == "LDSM" and _is_ldsm_t(ins):
            c["LDSM.T"] += 1
    c["FP32 (FADD+FMUL+FFMA)"] = c["FADD"] + c["FMUL"] + c["FFMA"]
    if waited:
        c["SYNCS wait"] = len(waited)
    out = dict(sorted(c.items()))
    out["wgmma"] = dict(sorted(wgmma.items()))
    return out


def pv_wait(instrs: list[Instr], block_n: int) -> dict | None:
    """Where the PV GEMM's wait sits: the first WARPGROUP.DEPBAR after the PV group (in loop
    order, wrapping into the next iteration) that retires it, and what runs before it."""
    groups: list[str] = []  # roles of the groups committed so far, oldest first (two iterations)
    roles_in_group: list[str] = []
    pv_at = None
    n = len(instrs)
    for k in range(2 * n):
        ins = instrs[k % n]
        role = wgmma_role(ins, block_n)
        if role:
            roles_in_group.append(role)
            if "gsb0" in ins.operands:
                groups.append("pv" if "pv" in roles_in_group else "qk")
                roles_in_group = []
                if groups[-1] == "pv" and pv_at is None and k < n:
                    pv_at = (len(groups) - 1, k)
            continue
        m = _DEPBAR_RE.search(ins.operands) if ins.opcode.startswith("WARPGROUP.DEPBAR") else None
        if m and pv_at is not None and k > pv_at[1]:
            in_flight = int(m.group(1), 0)
            issued_after = len(groups) - 1 - pv_at[0]
            if issued_after >= in_flight:
                before = instrs[:k % n]
                between = [instrs[j % n] for j in range(pv_at[1] + 1, k)]
                return {
                    "index": k % n,
                    "wraps": k >= n,
                    "depbar": ins.text,
                    "fmnmx_before": sum(i.base == "FMNMX" for i in before),
                    "ex2_before": sum(_is_ex2(i) for i in before),
                    "fmnmx_between_issue_and_wait": sum(i.base == "FMNMX" for i in between),
                    "ex2_between_issue_and_wait": sum(_is_ex2(i) for i in between),
                    "instructions_between_issue_and_wait": len(between),
                }
    return None


def skipped_ranges(cfg: Cfg, path: list[int], block_n: int) -> list[dict]:
    """Forward branches taken on the path and what they jump over inside the loop."""
    out = []
    on_path = set(path)
    for a, b in zip(path, path[1:]):
        if b == a + 1:
            continue
        branch = cfg.instrs[cfg.blocks[a].end - 1]
        first, last = cfg.blocks[a + 1].start, cfg.blocks[b].start
        skipped = cfg.instrs[first:last]
        if _unconditional(branch) or not skipped or any(x in on_path for x in range(a + 1, b)):
            continue
        c = count_ops(skipped, block_n)
        keep = {k: v for k, v in c.items() if k != "wgmma" and v and k in (
            "total", "MUFU.EX2", "MUFU other", "FMNMX", "FMUL", "FFMA", "FADD", "FSEL", "F2FP",
            "SYNCS", "BAR", "integer")}
        keep["wgmma"] = c["wgmma"]
        out.append({"branch": branch.text,
                    "from": hex(cfg.instrs[first].addr), "to": hex(cfg.instrs[last - 1].addr),
                    "counts": keep})
    return out


def _per_keys(counts: dict, block_n: int) -> dict:
    f = KEYS_PER_ROW / block_n
    return {k: (round(v * f, 1) if isinstance(v, int) else {kk: round(vv * f, 1)
                                                            for kk, vv in v.items()})
            for k, v in counts.items()}


def consumer_loop(cfg: Cfg, block_n: int, avoid: str = DEFAULT_AVOID,
                  longest: bool = True) -> dict | None:
    wanted = {"qk": lambda i: wgmma_role(i, block_n) == "qk",
              "pv": lambda i: wgmma_role(i, block_n) == "pv",
              "ex2": _is_ex2}
    loops = cfg.loops()
    cands = [(len(body), head, body) for head, body in loops.items()
             if _features([i for b in body for i in cfg.block_instrs(b)], wanted) == 7]
    if not cands:
        return None
    _, head, body = min(cands, key=lambda t: (t[0], t[1]))
    path = best_path(cfg, body, head, wanted, avoid, longest)
    if not path:
        return None
    instrs = [i for b in path for i in cfg.block_instrs(b)]
    counts = count_ops(instrs, block_n)
    qk_groups = sum(1 for i in instrs if wgmma_role(i, block_n) == "qk" and "gsb0" in i.operands)
    return {
        "header": hex(cfg.instrs[cfg.blocks[head].start].addr),
        "loop_blocks": len(body),
        "loop_instructions": sum(cfg.blocks[b].end - cfg.blocks[b].start for b in body),
        "path": [hex(cfg.instrs[cfg.blocks[b].start].addr) for b in path],
        "kv_blocks_per_iteration": qk_groups,
        "per_iteration": counts,
        "per_128_keys": _per_keys(counts, block_n * max(qk_groups, 1)),
        "pv_wait": pv_wait(instrs, block_n),
        "depbars": [{"index": k, "text": i.text,
                     "fmnmx_before": sum(j.base == "FMNMX" for j in instrs[:k]),
                     "ex2_before": sum(_is_ex2(j) for j in instrs[:k])}
                    for k, i in enumerate(instrs) if i.opcode.startswith("WARPGROUP.DEPBAR")],
        "skipped": skipped_ranges(cfg, path, block_n),
    }


def transpose_loop(cfg: Cfg, block_n: int) -> dict | None:
    """The FP8 V transposer's per-tile loop (LDSM transposing + STSM + an mbarrier operation)
    and, when the units run in a loop of their own inside it, that loop per trip."""
    def has(body, test):
        return any(test(i) for b in body for i in cfg.block_instrs(b))

    loops = cfg.loops()
    tile = [(len(body), head, body) for head, body in loops.items()
            if has(body, _is_ldsm_t) and has(body, lambda i: i.base == "STSM")
            and has(body, lambda i: i.base == "SYNCS")]
    if not tile:
        return None
    _, head, body = min(tile, key=lambda t: (t[0], t[1]))
    wanted = {"ldsm": _is_ldsm_t, "stsm": lambda i: i.base == "STSM"}

    def per_tile(h: int, b: set[int]) -> dict:
        # The shortest path: a warp that only transposes (FA3's warp 0 also issues the K / V TMA
        # loads from this loop, behind a branch the other warps skip).
        path = best_path(cfg, b, h, wanted, longest=False)
        return count_ops([i for blk in path for i in cfg.block_instrs(blk)], block_n)

    out = {"header": hex(cfg.instrs[cfg.blocks[head].start].addr),
           "per_tile_path": per_tile(head, body)}
    # One per-V-tile loop per copy of the code: the candidates holding no other candidate.
    copies = sorted((h, b) for _, h, b in tile if not any(b2 < b for _, _, b2 in tile))
    if len(copies) > 1:
        out["per_copy"] = [{"header": hex(cfg.instrs[cfg.blocks[h].start].addr),
                            "per_tile_path": per_tile(h, b)} for h, b in copies]
        out["per_tile_all_copies"] = dict(sum(
            (Counter({k: v for k, v in c["per_tile_path"].items() if isinstance(v, int)})
             for c in out["per_copy"]), Counter()))
    inner = [(len(b2), h2, b2) for h2, b2 in loops.items()
             if h2 != head and b2 < body and has(b2, _is_ldsm_t)]
    if inner:
        _, h2, b2 = min(inner, key=lambda t: (t[0], t[1]))
        p2 = best_path(cfg, b2, h2, wanted, longest=False)
        out["unit_loop"] = {
            "header": hex(cfg.instrs[cfg.blocks[h2].start].addr),
            "per_trip": count_ops([i for b in p2 for i in cfg.block_instrs(b)], block_n)}
    return out


# ---------------------------------------------------------------------------------------------
# Reading binaries
# ---------------------------------------------------------------------------------------------

def _demangle(names: list[str]) -> dict[str, str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True,
                             text=True, check=True).stdout.splitlines()
        return dict(zip(names, out))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def kernel_resources(binary: str) -> dict[str, dict]:
    """Mangled name -> registers / static shared memory of every kernel of a binary
    (`cuobjdump -res-usage`: no disassembly, fast; `-ltext` truncates long names)."""
    out = subprocess.run(["cuobjdump", "-res-usage", binary], capture_output=True, text=True,
                         check=True).stdout
    res: dict[str, dict] = {}
    name = None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name and name not in res:
            res[name] = {"registers": int(m.group(1)), "stack": int(m.group(2)),
                         "static_shared": int(m.group(3)), "local": int(m.group(4))}
    return res


def _is_text(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    return b"\0" not in head


def select(binary: str, pattern: str) -> tuple[str, list[Instr], dict]:
    """The one kernel of `binary` whose mangled or demangled name matches `pattern`, its
    instructions and its resources (empty for a text dump)."""
    rx = re.compile(pattern)
    resources: dict[str, dict] = {}
    if _is_text(binary):
        with open(binary) as f:
            funcs = parse_sass(f.read())
        names = list(funcs)
    else:
        resources = kernel_resources(binary)
        funcs, names = {}, list(resources)
    demangled = _demangle(names)
    hits = [n for n in names if rx.search(n) or rx.search(demangled[n])]
    if len(hits) != 1:
        listing = "\n  ".join(demangled[n][:200] for n in hits[:20])
        sys.exit(f"{binary}: {len(hits)} kernels match {pattern!r} (need exactly one)"
                 + (f":\n  {listing}" if hits else ""))
    name = hits[0]
    if name not in funcs:
        text = subprocess.run(["cuobjdump", "-sass", "-fun", name, binary], capture_output=True,
                              text=True, check=True).stdout
        funcs = parse_sass(text)
    return name, funcs[name], resources.get(name, {})


def analyze(binary: str, pattern: str, block_n: int, avoid: str = DEFAULT_AVOID,
            longest: bool = True) -> dict:
    name, instrs, resources = select(binary, pattern)
    cfg = Cfg(instrs)
    return {
        "binary": binary,
        "kernel": name,
        "demangled": _demangle([name])[name],
        "block_n": block_n,
        "instructions": len(instrs),
        "resources": resources,
        "path_policy": {"longest": longest, "avoid": avoid},
        "consumer_loop": consumer_loop(cfg, block_n, avoid, longest),
        "transpose_loop": transpose_loop(cfg, block_n),
    }


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------

_ROWS = [
    ("QK WGMMA", lambda c: c.get("wgmma_qk", 0)),
    ("PV WGMMA", lambda c: c.get("wgmma_pv", 0)),
    ("MUFU.EX2", lambda c: c.get("MUFU.EX2", 0)),
    ("MUFU other", lambda c: c.get("MUFU other", 0)),
    ("FMNMX", lambda c: c.get("FMNMX", 0)),
    ("SHFL", lambda c: c.get("SHFL", 0)),
    ("FADD", lambda c: c.get("FADD", 0)),
    ("FMUL", lambda c: c.get("FMUL", 0)),
    ("FFMA", lambda c: c.get("FFMA", 0)),
    ("F2FP (P packing)", lambda c: c.get("F2FP", 0)),
    ("PRMT (data / all)", lambda c: f"{c.get('PRMT data', 0)} / {c.get('PRMT', 0)}"),
    ("LDSM / STSM", lambda c: f"{c.get('LDSM', 0)} / {c.get('STSM', 0)}"),
    ("BAR (named barriers)", lambda c: c.get("BAR", 0)),
    ("SYNCS wait / arrive", lambda c: f"{c.get('SYNCS wait', 0)} / {c.get('SYNCS arrive', 0)}"),
    ("WARPGROUP.ARRIVE", lambda c: c.get("WARPGROUP.ARRIVE", 0)),
    ("WARPGROUP.DEPBAR", lambda c: c.get("WARPGROUP.DEPBAR", 0)),
    ("NOP", lambda c: c.get("NOP", 0)),
    ("integer / uniform", lambda c: f"{c.get('integer', 0)} / {c.get('uniform', 0)}"),
    ("total", lambda c: c.get("total", 0)),
]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return str(v)


_TRANSPOSE_ROWS = ["LDSM.T", "PRMT data", "STSM", "SYNCS wait", "SYNCS arrive", "BAR", "integer",
                   "uniform", "total"]


def _transpose_table(case: str, labels: list[str], results: dict[str, dict]) -> list[str]:
    """The V transposer's counts per warp: its per-tile path (a unit loop inside it taken once)
    and the unit loop per trip."""
    cols = []
    for lb in labels:
        t = results[lb].get("transpose_loop")
        if t and "per_copy" in t:
            side = lb.partition(':')[0]
            cols += [(f"{side}: copy {k} per-tile path", c["per_tile_path"])
                     for k, c in enumerate(t["per_copy"])]
            cols.append((f"{side}: all copies per tile", t["per_tile_all_copies"]))
        elif t:
            cols.append((f"{lb.partition(':')[0]}: per-tile path", t["per_tile_path"]))
            if "unit_loop" in t:
                cols.append((f"{lb.partition(':')[0]}: unit loop, per trip",
                             t["unit_loop"]["per_trip"]))
    if not cols:
        return []
    lines = [f"V transposer ({case}), per producer thread (= per warp instruction):", "",
             "| | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for row in _TRANSPOSE_ROWS:
        lines.append(f"| {row} | " + " | ".join(str(c[1].get(row, 0)) for c in cols) + " |")
    return lines + [""]


def markdown(results: dict[str, dict]) -> str:
    cases: dict[str, list[str]] = {}
    for label in results:
        side, _, case = label.partition(":")
        cases.setdefault(case or side, []).append(label)
    lines = []
    for case, labels in cases.items():
        loops = [results[lb]["consumer_loop"] for lb in labels]
        if any(lp is None for lp in loops):
            lines.append(f"### {case}: no consumer loop found in " + ", ".join(
                lb for lb, lp in zip(labels, loops) if lp is None) + "\n")
            continue
        head = ["per consumer thread"]
        for lb in labels:
            r = results[lb]
            head.append(f"{lb.partition(':')[0]} (N={r['block_n']}): /iter")
            head.append("/128 keys")
        lines.append(f"### {case}\n")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for name, get in _ROWS:
            row = [name]
            for lp in loops:
                a, b = get(lp["per_iteration"]), get(lp["per_128_keys"])
                row += [_fmt(a), _fmt(b) if not isinstance(b, str) else ""]
            lines.append("| " + " | ".join(row) + " |")
        row = ["WGMMA shapes"]
        for lp in loops:
            row += ["<br>".join(f"{v}x {k}" for k, v in lp["per_iteration"]["wgmma"].items()), ""]
        lines.append("| " + " | ".join(row) + " |")
        row = ["PV wait: FMNMX / EX2 before it (of the iteration's)"]
        for lp in loops:
            w, c = lp["pv_wait"], lp["per_iteration"]
            row += [("next iter. " if w and w["wraps"] else "") +
                    (f"{w['fmnmx_before']} / {w['ex2_before']} (of {c.get('FMNMX', 0)} / "
                     f"{c.get('MUFU.EX2', 0)})" if w else "-"), ""]
        lines.append("| " + " | ".join(row) + " |")
        row = ["EX2 / instructions between PV issue and its wait"]
        for lp in loops:
            w = lp["pv_wait"]
            row += [f"{w['ex2_between_issue_and_wait']} / "
                    f"{w['instructions_between_issue_and_wait']}" if w else "-", ""]
        lines.append("| " + " | ".join(row) + " |")
        lines.append("")
        lines += _transpose_table(case, labels, results)
        for lb, lp in zip(labels, loops):
            skipped = [s for s in lp["skipped"] if s["counts"].get("total", 0) < 2000]
            if skipped:
                lines.append(f"{lb}: branches the counted path jumps over:")
                for s in skipped:
                    desc = ", ".join(f"{k} {v}" for k, v in s["counts"].items()
                                     if k != "wgmma" and k != "total")
                    lines.append(f"- `{s['branch']}` skips {s['counts']['total']} instructions "
                                 f"({s['from']}..{s['to']}){': ' + desc if desc else ''}")
                lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", nargs="?", help=".so / .o / .cubin, or a SASS text dump")
    ap.add_argument("--kernel", help="regex selecting one kernel (mangled or demangled name)")
    ap.add_argument("--block-n", type=int, help="keys per KV block of that kernel")
    ap.add_argument("--case", nargs=4, action="append", default=[],
                    metavar=("LABEL", "BINARY", "REGEX", "BLOCK_N"),
                    help="one kernel to compare; LABEL is side:case (ours:bf16-d128)")
    ap.add_argument("--avoid", default=DEFAULT_AVOID,
                    help="regex of opcodes the counted consumer path must not contain "
                         "(default: softcap, mask and epilogue code)")
    ap.add_argument("--shortest", action="store_true",
                    help="count the shortest qualifying path instead of the longest")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the comparison tables here")
    args = ap.parse_args(argv)
    cases = [(lb, b, rx, int(n)) for lb, b, rx, n in args.case]
    if args.binary:
        if not args.kernel or not args.block_n:
            ap.error("BINARY needs --kernel and --block-n")
        cases.append(("kernel", args.binary, args.kernel, args.block_n))
    if not cases:
        ap.error("give BINARY --kernel --block-n, or --case")
    results = {lb: analyze(b, rx, n, args.avoid, not args.shortest) for lb, b, rx, n in cases}
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results) + "\n")
    if not args.json and not args.markdown:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
