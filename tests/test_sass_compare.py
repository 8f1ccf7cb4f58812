"""CPU tests of bench/sass_compare.py's SASS parsing and loop analysis on synthetic SASS text (no
cuobjdump, no GPU): a fake consumer loop with a back edge, run-time branches and an out-of-line
mbarrier retry that jumps back into the loop, in both branch-target styles (cuobjdump's hex
addresses, nvdisasm's labels)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "sass_compare.py"
_spec = importlib.util.spec_from_file_location("sass_compare", _PATH)
sc = importlib.util.module_from_spec(_spec)
sys.modules["sass_compare"] = sc  # dataclasses look their module up there
_spec.loader.exec_module(sc)

BLOCK_N = 96  # the fake kernel's keys per block: its QK WGMMA is m64n96k16


def assemble(name: str, body: list[str]) -> str:
    """cuobjdump-style text: each line gets the next address (0x10 apart) and an encoding
    comment; `LABEL:` lines name the next instruction, `=>LABEL` in an operand is its address."""
    addrs, addr = {}, 0
    for line in body:
        if line.endswith(":"):
            addrs[line[:-1]] = addr
        else:
            addr += 0x10
    out = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
    addr = 0
    for line in body:
        if line.endswith(":"):
            continue
        text = re.sub(r"=>(\w+)", lambda m: hex(addrs[m.group(1)]), line)
        out.append(f"        /*{addr:04x}*/                   {text} ;"
                   f"                 /* 0x000fe20000000f00 */")
        out.append("                                                 /* 0x000fc40000000a00 */")
        addr += 0x10
    return "\n".join(out) + "\n"


# One consumer step per trip of LOOP: wait K (retry out of line), QK GEMM (2 x SS m64n96k16), PV
# GEMM (2 x RS m64n64k16), wait for S, softcap behind a run-time branch (tanh: never counted),
# row max / exp2 (3 FMNMX, 2 EX2 before the PV wait), the PV wait, 1 more EX2, an optional O
# rescale behind a branch (2 FMUL: the longest path counts it, the shortest does not), P packing.
LOOP = [
    "S2R R0, SR_TID.X",
    "LOOP:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x30], R2",
    "@!P0 BRA =>RETRY",
    "BACK:",
    "BAR.SYNC.DEFER_BLOCKING R9, 0x100",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT",
    "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR12], R24, gsb0",
    "WARPGROUP.ARRIVE",
    "HGMMA.64x64x16.F32.BF16 R80, R120, gdesc[UR16].tnspB, R80",
    "HGMMA.64x64x16.F32.BF16 R80, R124, gdesc[UR20].tnspB, R80, gsb0",
    "BAR.ARV R9, 0x100",
    "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    "@!P1 BRA =>NOCAP",
    "MUFU.TANH R24, R24",
    "FMUL.FTZ R24, R24, UR5",
    "NOCAP:",
    "FMNMX.FTZ R3, R24, R25, !PT",
    "FMNMX.FTZ R3, R3, R26, !PT",
    "SHFL.BFLY PT, R4, R3, 0x1, 0x1f",
    "FMNMX.FTZ R3, R3, R4, !PT",
    "FFMA.FTZ R24, R24, UR6, -R3",
    "MUFU.EX2 R24, R24",
    "MUFU.EX2 R25, R25",
    "WARPGROUP.DEPBAR.LE gsb0, 0x0",
    "MUFU.EX2 R26, R26",
    "FADD.FTZ R5, R24, R25",
    "@!P2 BRA =>NORESCALE",
    "FMUL.FTZ R80, R80, R6",
    "FMUL.FTZ R81, R81, R6",
    "NORESCALE:",
    "F2FP.BF16.F32.PACK_AB R120, R25, R24",
    "PRMT R7, RZ, 0x654, R7",
    "@!P3 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R7+URZ], RZ",
    "ISETP.GT.AND P4, PT, R10, RZ, PT",
    "@P4 BRA =>LOOP",
    "EXIT",
    "RETRY:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x30], R2",
    "@!P0 BRA =>RETRY",
    "BRA =>BACK",
]

# The transposer: per V tile, wait V, a unit loop (LDSM.T, 4 PRMT, STSM), then release.
TRANSPOSER = [
    "TILE:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x40], R2",
    "MOV R5, RZ",
    "UNIT:",
    "LDSM.16.MT88.4 R12, [R8]",
    "PRMT R16, R12, 0x6420, R13",
    "PRMT R17, R12, 0x7531, R13",
    "PRMT R18, R14, 0x6420, R15",
    "PRMT R19, R14, 0x7531, R15",
    "STSM.16.M88.4 [R9], R16",
    "IADD3 R5, R5, 0x3, RZ",
    "ISETP.GE.AND P1, PT, R5, 0x8, PT",
    "@!P1 BRA =>UNIT",
    "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+0x48], RZ",
    "ISETP.GT.AND P2, PT, R11, RZ, PT",
    "@P2 BRA =>TILE",
    "EXIT",
]


# Straight-line transposer warps, each with a copy of its own (warp 0: two units, warp 1: one),
# picked once by the warp index; per V tile each copy waits, transposes and releases.
TRANSPOSER_COPIES = [
    "ISETP.NE.AND P3, PT, R0, RZ, PT",
    "@P3 BRA =>TILE1",
    "TILE0:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x40], R2",
    "LDSM.16.MT88.4 R12, [R8]",
    "LOP3.LUT R10, R8, 0x10, RZ, 0x3c, !PT",
    "LDSM.16.MT88.4 R4, [R10]",
    "PRMT R16, R12, R2, R13",
    "PRMT R17, R12, R3, R13",
    "PRMT R18, R14, R2, R15",
    "PRMT R19, R14, R3, R15",
    "STSM.16.M88.4 [R9], R16",
    "PRMT R16, R4, R2, R5",
    "PRMT R17, R4, R3, R5",
    "PRMT R18, R6, R2, R7",
    "PRMT R19, R6, R3, R7",
    "STSM.16.M88.4 [R9+0x800], R16",
    "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+0x48], RZ",
    "ISETP.GT.AND P2, PT, R11, RZ, PT",
    "@P2 BRA =>TILE0",
    "EXIT",
    "TILE1:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x40], R2",
    "LDSM.16.MT88.4 R12, [R8+0x1000]",
    "PRMT R16, R12, R2, R13",
    "PRMT R17, R12, R3, R13",
    "PRMT R18, R14, R2, R15",
    "PRMT R19, R14, R3, R15",
    "STSM.16.M88.4 [R9+0x1000], R16",
    "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR4+0x48], RZ",
    "ISETP.GT.AND P2, PT, R11, RZ, PT",
    "@P2 BRA =>TILE1",
    "EXIT",
]


def _loop_text(labels: bool = False) -> str:
    text = assemble("_Z4fakev", LOOP)
    if not labels:
        return text
    # nvdisasm style: `.L_x_N:` lines and `(.L_x_N)` targets instead of hex addresses.
    instrs = sc.parse_sass(text)["_Z4fakev"]
    targets = sorted({i.target for i in instrs if i.target is not None})
    names = {t: f".L_x_{k}" for k, t in enumerate(targets)}
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4})\*/", line)
        if m and int(m.group(1), 16) in names:
            out.append(f"{names[int(m.group(1), 16)]}:")
        line = re.sub(r"(BRA\s+)(0x[0-9a-f]+)",
                      lambda mm: f"{mm.group(1)}`({names[int(mm.group(2), 16)]})", line)
        out.append(line)
    return "\n".join(out)


def test_parse_instructions_guards_and_targets():
    instrs = sc.parse_sass(_loop_text())["_Z4fakev"]
    assert len(instrs) == len([x for x in LOOP if not x.endswith(":")])
    hgmma = [i for i in instrs if i.base == "HGMMA"]
    assert [i.opcode for i in hgmma[:1]] == ["HGMMA.64x96x16.F32.BF16"]
    assert sc.wgmma_shape(hgmma[0]) == (64, 96, 16)
    back = next(i for i in instrs if i.text.startswith("@P4 BRA"))
    assert back.guard == "@P4 " and back.target == instrs[1].addr  # LOOP: the first TRYWAIT


def test_label_targets_parse_like_hex_targets():
    hexed = sc.parse_sass(_loop_text())["_Z4fakev"]
    labelled = sc.parse_sass(_loop_text(labels=True))["_Z4fakev"]
    assert [i.target for i in labelled] == [i.target for i in hexed]
    assert any(i.target is not None for i in labelled)


def test_branch_forms():
    def ins(guard, op, operands):
        i = sc.Instr(0x100, guard, op, operands)
        hexes = re.findall(r"0x[0-9a-f]+", operands)
        i.target = int(hexes[-1], 16) if hexes else None
        return i

    assert sc._unconditional(ins("", "BRA", "0x40"))
    assert not sc._unconditional(ins("@!P0 ", "BRA", "0x40"))
    assert not sc._unconditional(ins("", "BRA", "P2, 0x40"))  # a predicate operand
    assert not sc._unconditional(ins("", "BRA.DIV", "UR8, 0x40"))
    assert not sc._unconditional(ins("", "BRA.U.ANY", "0x40"))
    assert sc._unconditional(ins("", "EXIT", "")) and not sc._unconditional(ins("@P0 ", "EXIT", ""))
    text = assemble("_Z2brv", ["L:", "@!P1 BRA P2, =>L", "BRA.DIV UR8, =>L", "EXIT"])
    assert [i.target for i in sc.parse_sass(text)["_Z2brv"]] == [0x0, 0x0, None]


def test_prmt_address_forms_are_not_data():
    c = sc.count_ops([sc.Instr(0, "", "PRMT", "R7, RZ, 0x654, R7"),
                      sc.Instr(0x10, "", "PRMT", "R7, R8, 0x654, R7"),
                      sc.Instr(0x20, "", "PRMT", "R9, R10, 0x5410, R11")], BLOCK_N)
    assert c["PRMT"] == 3 and c["PRMT data"] == 1


def test_wgmma_roles():
    instrs = sc.parse_sass(_loop_text())["_Z4fakev"]
    roles = [sc.wgmma_role(i, BLOCK_N) for i in instrs if i.base == "HGMMA"]
    assert roles == ["qk", "qk", "pv", "pv"]
    # An SS WGMMA whose N is not the block's keys is the PV GEMM (P through shared memory).
    ss_pv = sc.Instr(0, "", "HGMMA.64x64x16.F32.BF16", "R80, gdesc[UR16], R80, gsb0")
    assert sc.wgmma_role(ss_pv, BLOCK_N) == "pv"
    assert sc.wgmma_role(instrs[0], BLOCK_N) is None


def test_retry_stub_is_not_a_loop():
    cfg = sc.Cfg(sc.parse_sass(_loop_text())["_Z4fakev"])
    heads = {cfg.instrs[cfg.blocks[h].start].addr for _, h in cfg.back_edges}
    retry = [i.addr for i in cfg.instrs if i.opcode.startswith("SYNCS")][-1]
    # The consumer loop's header and the retry's own spin; not the retry's jump back to BACK.
    assert heads == {0x10, retry}


def test_consumer_loop_counts_and_wait_placement():
    cfg = sc.Cfg(sc.parse_sass(_loop_text())["_Z4fakev"])
    loop = sc.consumer_loop(cfg, BLOCK_N)
    c = loop["per_iteration"]
    assert c["wgmma_qk"] == 2 and c["wgmma_pv"] == 2
    assert c["wgmma"] == {"HGMMA.64x96x16 QK SS": 2, "HGMMA.64x64x16 PV RS": 2}
    assert c["MUFU.EX2"] == 3 and "MUFU other" not in c  # the softcap's tanh is avoided
    assert c["FMNMX"] == 3 and c["SHFL"] == 1
    assert c["FMUL"] == 2  # the optional rescale: the longest path runs it
    assert c["PRMT"] == 1 and "PRMT data" not in c  # the 0x654 form is an address
    assert c["SYNCS wait"] == 1 and c["SYNCS arrive"] == 1
    assert c["BAR"] == 2 and c["WARPGROUP.ARRIVE"] == 2 and c["WARPGROUP.DEPBAR"] == 2
    # LOOP .. the back edge: 32 instructions less the two of the softcap block.
    assert c["total"] == 30
    assert loop["kv_blocks_per_iteration"] == 1
    assert loop["per_128_keys"]["MUFU.EX2"] == pytest.approx(3 * 128 / BLOCK_N, abs=0.05)
    w = loop["pv_wait"]
    assert w["depbar"] == "WARPGROUP.DEPBAR.LE gsb0, 0x0" and not w["wraps"]
    assert (w["fmnmx_before"], w["ex2_before"]) == (3, 2)
    assert w["ex2_between_issue_and_wait"] == 2
    assert [d["text"][-3:] for d in loop["depbars"]] == ["0x1", "0x0"]
    skipped = [s["counts"] for s in loop["skipped"]]
    assert skipped == [{"MUFU other": 1, "FMUL": 1, "total": 2, "wgmma": {}}]


def test_shortest_path_drops_the_optional_block():
    cfg = sc.Cfg(sc.parse_sass(_loop_text())["_Z4fakev"])
    loop = sc.consumer_loop(cfg, BLOCK_N, longest=False)
    assert loop["per_iteration"].get("FMUL", 0) == 0
    assert loop["per_iteration"]["total"] == 28
    # Without the avoid list the longest path takes the softcap too.
    loop = sc.consumer_loop(cfg, BLOCK_N, avoid="")
    assert loop["per_iteration"]["MUFU other"] == 1


def test_wait_that_wraps_into_the_next_iteration():
    # PV issued last, waited for at the top of the next trip (a sequential schedule).
    body = ["LOOP:", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "FMNMX.FTZ R3, R24, R25, !PT",
            "MUFU.EX2 R24, R24", "WARPGROUP.ARRIVE",
            "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R25, R25", "WARPGROUP.ARRIVE",
            "HGMMA.64x64x16.F32.BF16 R80, R120, gdesc[UR16], R80, gsb0",
            "@P4 BRA =>LOOP", "EXIT"]
    cfg = sc.Cfg(sc.parse_sass(assemble("_Z3seqv", body))["_Z3seqv"])
    w = sc.consumer_loop(cfg, BLOCK_N)["pv_wait"]
    assert w["wraps"] and w["index"] == 0
    assert (w["fmnmx_before"], w["ex2_before"]) == (0, 0)
    assert w["instructions_between_issue_and_wait"] == 1  # the back edge


def test_no_consumer_loop_without_both_gemms():
    body = ["LOOP:", "MUFU.EX2 R24, R24", "HGMMA.64x96x16.F32.BF16 R24, gdesc[UR8], RZ, gsb0",
            "@P4 BRA =>LOOP", "EXIT"]
    cfg = sc.Cfg(sc.parse_sass(assemble("_Z2qkv", body))["_Z2qkv"])
    assert sc.consumer_loop(cfg, BLOCK_N) is None


def test_transposer_tile_and_unit_loops():
    cfg = sc.Cfg(sc.parse_sass(assemble("_Z2trv", TRANSPOSER))["_Z2trv"])
    t = sc.transpose_loop(cfg, BLOCK_N)
    assert t["header"] == "0x0"
    unit = t["unit_loop"]["per_trip"]
    assert (unit["LDSM.T"], unit["PRMT data"], unit["STSM"], unit["total"]) == (1, 4, 1, 9)
    tile = t["per_tile_path"]  # the unit loop once, plus the wait and the release
    assert tile["total"] == 14 and tile["SYNCS wait"] == 1 and tile["SYNCS arrive"] == 1


def test_transposer_copies_per_warp():
    cfg = sc.Cfg(sc.parse_sass(assemble("_Z2trv", TRANSPOSER_COPIES))["_Z2trv"])
    t = sc.transpose_loop(cfg, BLOCK_N)
    assert "unit_loop" not in t
    copies = [c["per_tile_path"] for c in t["per_copy"]]
    assert [(c["LDSM.T"], c["PRMT data"], c["STSM"], c["total"]) for c in copies] == [
        (2, 8, 2, 17), (1, 4, 1, 10)]
    assert t["per_tile_path"] == copies[0]  # the smallest loop, then the first: as before
    total = t["per_tile_all_copies"]
    assert (total["LDSM.T"], total["STSM"], total["SYNCS arrive"], total["total"]) == (3, 3, 2, 27)
    table = "\n".join(sc._transpose_table("e4m3-d128", ["ours:e4m3-d128"],
                                           {"ours:e4m3-d128": {"transpose_loop": t}}))
    assert "ours: copy 1 per-tile path" in table and "ours: all copies per tile" in table
    assert "| total | 17 | 10 | 27 |" in table


def test_markdown_pairs_the_sides_of_a_case():
    cfg = sc.Cfg(sc.parse_sass(_loop_text())["_Z4fakev"])
    r = {"block_n": BLOCK_N, "consumer_loop": sc.consumer_loop(cfg, BLOCK_N)}
    md = sc.markdown({"ours:bf16-d64": r, "fa3:bf16-d64": r})
    assert "### bf16-d64" in md
    header = next(ln for ln in md.splitlines() if ln.startswith("| per consumer thread"))
    assert "ours (N=96)" in header and "fa3 (N=96)" in header
    ex2 = next(ln for ln in md.splitlines() if ln.startswith("| MUFU.EX2 "))
    assert ex2 == "| MUFU.EX2 | 3 | 4 | 3 | 4 |"


def test_select_refuses_ambiguous_patterns(tmp_path):
    p = tmp_path / "two.sass"
    p.write_text(assemble("_Z4fakev", LOOP) + assemble("_Z5fake2v", LOOP))
    with pytest.raises(SystemExit):
        sc.select(str(p), "fake")
    name, instrs, res = sc.select(str(p), "fake2")
    assert name == "_Z5fake2v" and len(instrs) > 0 and res == {}
