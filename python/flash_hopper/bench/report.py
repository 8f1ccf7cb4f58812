"""Result files (JSON, CSV) and the terminal table.

A result set is {"schema", "meta", "results"}: meta holds the environment (env.collect), the
options, the ceilings and the repro command; results holds one row per (case, backend,
direction). The CSV carries the same meta as a JSON comment line above the header, so either file
alone can be re-plotted or audited.

Backward rows (bwd, fwd+bwd) add the gradient check (check_{dq,dk,dv}_{err,tol}, check_grad_pass;
their check_pass covers the forward's check and the gradients') and the backward's memory
(bwd_workspace_bytes by the backend's formula, bwd_extra_bytes measured: memory.py). Files
written before these columns existed read back with them empty.

check_metric says what check_err / check_tol measure: "max-abs" (FA3's rule; also what an empty
cell in an older file means; mixed-mode rows too) or "rel-rmse" (the FP8 rule, e4m3 rows:
check.py).

Mixed-mode rows (dtype "bf16+e4m3", ...) are reported next to the rows of q's dtype of the same
sweep by ``format_mixed_comparison``: one line per configuration timed in both, with the speedup.

Varlen rows (--varlen) carry the batch's lengths in ``seqlens`` (space-separated, the same string
in JSON and CSV; empty for dense rows), batch = their count and seqlen_q = seqlen_k = the longest;
tables show them as "varlen 7 seqs 128..8k (16k tok)" (``seqlen_cell``).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
from collections.abc import Iterable, Sequence

from .cases import MIXED_PARTS, varlen_label
from .check import FP8_REL_RMSE, METRIC_REL_RMSE

SCHEMA = "flash-hopper.bench/1"
_META_PREFIX = "# meta: "

# Column order of the CSV, with the type each column is read back as.
FIELDS: tuple[tuple[str, type], ...] = (
    ("backend", str), ("kernel", str), ("direction", str), ("dtype", str), ("batch", int),
    ("seqlen_q", int), ("seqlen_k", int), ("seqlens", str), ("heads", int), ("heads_kv", int),
    ("head_dim", int), ("causal", bool), ("window_left", int), ("window_right", int),
    ("softcap", float), ("mask", str), ("status", str), ("reason", str), ("ms", float),
    ("ms_p20", float), ("ms_p80", float), ("ms_min", float), ("ms_max", float), ("host_ms", float),
    ("iters", int), ("flops", float), ("tflops", float), ("pct_peak", float),
    ("pct_gemm", float), ("check_err", float), ("check_ref_err", float),
    ("check_tol", float), ("check_lse_err", float), ("check_lse_tol", float),
    ("check_pass", bool), ("check_shape", str), ("check_metric", str), ("check_dq_err", float),
    ("check_dq_tol", float), ("check_dk_err", float), ("check_dk_tol", float),
    ("check_dv_err", float), ("check_dv_tol", float), ("check_grad_pass", bool),
    ("bwd_workspace_bytes", int), ("bwd_extra_bytes", int), ("kernel_reason", str),
    ("notes", str),
)
FIELD_NAMES = tuple(name for name, _ in FIELDS)


def result_set(meta: dict[str, object], rows: Sequence[dict[str, object]]) -> dict[str, object]:
    return {"schema": SCHEMA, "meta": meta, "results": [normalize(r) for r in rows]}


def normalize(row: dict[str, object]) -> dict[str, object]:
    """Every field present (None when not applicable), in FIELDS order."""
    return {name: row.get(name) for name in FIELD_NAMES}


def write_json(path: str, data: dict[str, object]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=False)
        handle.write("\n")


def read_json(path: str) -> dict[str, object]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a flash-hopper bench result (schema {SCHEMA} expected)")
    return data


def write_csv(path: str, data: dict[str, object]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write(f"# flash-hopper bench results, schema {SCHEMA}\n")
        handle.write(_META_PREFIX + json.dumps(data["meta"], sort_keys=True) + "\n")
        writer = csv.DictWriter(handle, fieldnames=FIELD_NAMES, lineterminator="\n")
        writer.writeheader()
        for row in data["results"]:
            writer.writerow({k: _csv_value(v) for k, v in normalize(row).items()})


def _csv_value(value):
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest exact round-trip
    return value


def _parse(text: str, kind: type):
    if text == "":
        return None
    if kind is bool:
        return text.lower() == "true"
    if kind is int:
        return int(text)
    if kind is float:
        return float(text)
    return text


def read_csv(path: str) -> dict[str, object]:
    with open(path, encoding="utf-8", newline="") as handle:
        text = handle.read()
    meta: dict[str, object] = {}
    body = []
    for line in text.splitlines(keepends=True):
        if line.startswith(_META_PREFIX):
            meta = json.loads(line[len(_META_PREFIX):])
        elif not line.startswith("#"):
            body.append(line)
    types = dict(FIELDS)
    rows = [{k: _parse(v, types.get(k, str)) for k, v in record.items()}
            for record in csv.DictReader(io.StringIO("".join(body)))]
    return {"schema": SCHEMA, "meta": meta, "results": rows}


def read_results(path: str) -> dict[str, object]:
    return read_csv(path) if path.lower().endswith(".csv") else read_json(path)


def timestamped_stem(meta: dict[str, object], now: datetime.datetime | None = None) -> str:
    """bench-<gpu>-<UTC time>, e.g. bench-nvidia-h200-20250101-120000."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    gpu = (meta.get("gpu") or {}).get("name") or "nogpu"
    slug = re.sub(r"[^a-z0-9]+", "-", str(gpu).lower()).strip("-")
    return f"bench-{slug}-{now.strftime('%Y%m%d-%H%M%S')}"


def out_dir_paths(directory: str, meta: dict[str, object]) -> dict[str, str]:
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, timestamped_stem(meta))
    return {ext: f"{stem}.{ext}" for ext in ("json", "csv", "png")}


# ---- terminal table -------------------------------------------------------------------------

_COLUMNS = ("dir", "dtype", "mask", "d", "seqlen", "b", "h/kv", "backend", "kernel", "ms",
            "p20-p80 ms", "TFLOP/s", "%peak", "%gemm", "err", "check")
_RIGHT = {"d", "seqlen", "b", "h/kv", "ms", "p20-p80 ms", "TFLOP/s", "%peak", "%gemm", "err"}
# Under the table when an FP8 row is in it: its err is another quantity.
_ERR_LEGEND = ("err: max |out - ref_fp32| (FA3's rule), or with 'rms' the relative RMS error "
               "against fp32 on the dequantized inputs (e4m3 rows: pass <= {:.0%})")


def row_seqlens(row: dict[str, object]) -> list[int] | None:
    """A varlen row's lengths, None for a dense row (or a file from before the column)."""
    text = row.get("seqlens")
    return [int(n) for n in str(text).split()] if text else None


def seqlen_cell(row: dict[str, object]) -> str:
    """'512', '512/2048', or a varlen row's 'varlen 7 seqs 128..8k (16k tok)'."""
    lengths = row_seqlens(row)
    if lengths:
        return varlen_label(lengths)
    if row["seqlen_q"] == row["seqlen_k"]:
        return str(row["seqlen_q"])
    return f"{row['seqlen_q']}/{row['seqlen_k']}"


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_cells(row: dict[str, object]) -> list[str]:
    seqlen = seqlen_cell(row)
    spread = ("-" if row.get("ms_p20") is None
              else f"{row['ms_p20']:.3f}-{row['ms_p80']:.3f}")
    check = {True: "ok", False: "FAIL", None: "-"}[row.get("check_pass")]
    err = _fmt(row.get("check_err"), ".1e")
    if row.get("check_metric") == METRIC_REL_RMSE and row.get("check_err") is not None:
        err = f"{row['check_err']:.2%} rms"
    return [str(row["direction"]), str(row["dtype"]), str(row["mask"]), str(row["head_dim"]),
            seqlen, str(row["batch"]), f"{row['heads']}/{row['heads_kv']}", str(row["backend"]),
            str(row.get("kernel") or "-"), _fmt(row.get("ms"), ".3f"), spread,
            _fmt(row.get("tflops"), ".1f"), _fmt(row.get("pct_peak"), ".1f"),
            _fmt(row.get("pct_gemm"), ".1f"), err, check]


def _table_order(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Grouped by (direction, dtype, mask, head dim), then by lengths; backends keep run order
    (a stable sort), so each group reads like one panel of the plot."""
    def rank(field):
        seen: dict[object, int] = {}
        for row in rows:
            seen.setdefault(row[field], len(seen))
        return seen

    ranks = {f: rank(f) for f in ("direction", "dtype", "mask")}
    return sorted(rows, key=lambda r: (ranks["direction"][r["direction"]],
                                       ranks["dtype"][r["dtype"]], ranks["mask"][r["mask"]],
                                       r["head_dim"], r["seqlen_q"], r["seqlen_k"]))


def format_table(rows: Iterable[dict[str, object]]) -> str:
    timed = [r for r in rows if r.get("status") == "ok"]
    body = [table_cells(r) for r in _table_order(timed)]
    if not body:
        return "(no timed results)"
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(_COLUMNS)]

    def line(cells):
        return "  ".join(c.rjust(w) if name in _RIGHT else c.ljust(w)
                         for c, w, name in zip(cells, widths, _COLUMNS)).rstrip()

    out = [line(_COLUMNS), line(["-" * w for w in widths])]
    previous = None
    for cells in body:
        group = tuple(cells[:4])  # a blank line between (dir, dtype, mask, d) groups
        if previous is not None and group != previous:
            out.append("")
        previous = group
        out.append(line(cells))
    if any(r.get("check_metric") == METRIC_REL_RMSE for r in timed):
        out += ["", _ERR_LEGEND.format(FP8_REL_RMSE)]
    return "\n".join(out)


def format_skips(rows: Iterable[dict[str, object]]) -> str:
    """Skipped and failed rows grouped by (status, backend, direction, reason), with a count."""
    groups: dict[tuple[str, str, str, str], int] = {}
    for row in rows:
        if row.get("status") in ("skipped", "error"):
            key = (str(row["status"]), str(row["backend"]), str(row["direction"]),
                   str(row.get("reason")))
            groups[key] = groups.get(key, 0) + 1
    lines = [f"{status}: {backend} {direction} ({count} config{'s' * (count != 1)}): {reason}"
             for (status, backend, direction, reason), count in groups.items()]
    return "\n".join(lines)


def format_kernels(rows: Iterable[dict[str, object]]) -> str:
    """Which kernel each backend actually ran, and why, once per distinct answer."""
    seen: dict[tuple[str, str, str], None] = {}
    for row in rows:
        if row.get("status") == "ok":
            key = (str(row["backend"]), str(row.get("kernel") or "-"),
                   str(row.get("kernel_reason") or ""))
            seen[key] = None
    return "\n".join(f"{b}: ran {k}" + (f" ({r})" if r else "") for b, k, r in seen)


def _mib(value) -> str:
    return f"{value / 2**20:.1f}"


def format_memory(rows: Iterable[dict[str, object]]) -> str:
    """The backward's memory per config, one line each: per backend the library's workspace (ws)
    where it reports one and the measured extra beyond the gradients, in MiB. bwd and fwd+bwd
    rows carry the same measurement; each backend is listed once."""
    configs: dict[tuple, dict[str, str]] = {}
    for row in rows:
        workspace, extra = row.get("bwd_workspace_bytes"), row.get("bwd_extra_bytes")
        if "bwd" not in str(row["direction"]) or (workspace is None and extra is None):
            continue
        key = (f"{row['dtype']} d={row['head_dim']} s={seqlen_cell(row)} b={row['batch']} "
               f"h={row['heads']}/{row['heads_kv']} {row['mask']}")
        parts = ([f"ws {_mib(workspace)}"] if workspace is not None else []) + (
            [f"extra {_mib(extra)}"] if extra is not None else [])
        configs.setdefault(key, {}).setdefault(str(row["backend"]), " ".join(parts))
    return "\n".join(f"{key}: " + " | ".join(f"{b} {text}" for b, text in backends.items())
                     for key, backends in configs.items())


# What makes a mixed-mode row and a 16-bit row the same measurement, but for the dtype.
_SAME_CONFIG = ("backend", "direction", "batch", "seqlen_q", "seqlen_k", "heads", "heads_kv",
                "head_dim", "causal", "window_left", "window_right", "softcap")


def format_mixed_comparison(rows: Iterable[dict[str, object]]) -> str:
    """Each timed mixed-mode row next to the timed row of q's dtype with the same backend,
    direction and configuration, one line each: both medians and the speedup (16-bit ms / mixed
    ms; above 1: the FP8 K / V cache is faster). Empty when no such pair was timed."""
    timed = [r for r in rows if r.get("status") == "ok"]
    half = {(r["dtype"], *(r[f] for f in _SAME_CONFIG)): r for r in timed
            if r["dtype"] not in MIXED_PARTS}
    lines = []
    for row in _table_order([r for r in timed if r["dtype"] in MIXED_PARTS]):
        q_dtype = MIXED_PARTS[row["dtype"]][0]
        other = half.get((q_dtype, *(row[f] for f in _SAME_CONFIG)))
        if other is None:
            continue
        lines.append(
            f"{row['backend']} {row['direction']} {row['mask']} d={row['head_dim']} "
            f"s={seqlen_cell(row)} b={row['batch']} h={row['heads']}/{row['heads_kv']}: "
            f"{row['dtype']} "
            f"{row['ms']:.3f} ms vs {q_dtype} {other['ms']:.3f} ms, "
            f"{other['ms'] / row['ms']:.2f}x")
    return "\n".join(lines)
