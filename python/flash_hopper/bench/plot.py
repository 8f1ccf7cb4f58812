"""Grouped bar charts in the style of the FA3 paper's Figure 5.

One panel per (direction, dtype, mask) row x head-dim column, the rows grouped by direction
(forward, then backward, then forward + backward: the FA papers' figure order); in a panel, one group of bars per
sequence length and one bar per backend (same colour in every panel), the TFLOP/s value written on
each bar. A backend skipped for a whole panel is named in its corner ("n/a: ..."), a single
missing bar is marked with a small x, so a gap is never mistaken for zero. Uses matplotlib's
object API (no pyplot): no global state, no display needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .cases import short_count
from .report import row_seqlens, seqlen_cell

# Stable colours: ours first (strong), torch peers next, external packages last.
_PALETTE = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")
_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwd+bwd": "Forward + backward"}


def seqlen_label(row: dict[str, object]) -> str:
    """An x tick: '16k', '512/2k', or a varlen batch's summary (its panel has that one x)."""
    if row_seqlens(row):
        return seqlen_cell(row)
    sq, sk = int(row["seqlen_q"]), int(row["seqlen_k"])
    return short_count(sq) if sq == sk else f"{short_count(sq)}/{short_count(sk)}"


def _direction_rank(direction: str) -> int:
    return list(_TITLES).index(direction) if direction in _TITLES else len(_TITLES)


def _ordered(values) -> list:
    seen: dict[object, None] = {}
    for value in values:
        seen[value] = None
    return list(seen)


def layout(rows: Sequence[dict[str, object]]):
    """(panel rows, head-dim columns, backends, seqlen labels) of the ok rows, in run order."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tflops") is not None]
    # A sweep runs every direction of a case before the next case: group the panel rows by
    # direction instead (stable: (dtype, mask) keep their run order within a direction).
    panel_rows = sorted(_ordered((r["direction"], r["dtype"], r["mask"]) for r in ok),
                        key=lambda key: _direction_rank(key[0]))
    head_dims = sorted({int(r["head_dim"]) for r in ok})
    backends = _ordered(r["backend"] for r in rows)  # include skipped ones: stable colours
    ordered = sorted(ok, key=lambda r: (int(r["seqlen_q"]), int(r["seqlen_k"])))
    seqlens = _ordered(seqlen_label(r) for r in ordered)
    return panel_rows, head_dims, backends, seqlens


def _subtitle(meta: dict[str, object]) -> str:
    gpu = (meta.get("gpu") or {}).get("name") or "unknown GPU"
    lib = meta.get("library") or {}
    version = lib.get("version")
    commit = lib.get("commit")
    parts = [gpu]
    if version:
        parts.append(f"flash-hopper {version}" + (f" ({str(commit)[:10]})" if commit else ""))
    if meta.get("torch"):
        parts.append(f"torch {meta['torch']}")
    if meta.get("date"):
        parts.append(str(meta["date"])[:10])
    return ", ".join(parts)


def plot_results(data: dict[str, object], path: str, dpi: int = 120) -> dict[str, int]:
    """Write the figure to `path` (format from the extension); returns panel/bar counts."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = data.get("results") or []
    meta = data.get("meta") or {}
    panel_rows, head_dims, backends, seqlens = layout(rows)
    if not panel_rows:
        raise ValueError("no timed results to plot (every row was skipped or failed)")
    colours = {b: _PALETTE[i % len(_PALETTE)] for i, b in enumerate(backends)}
    n_rows, n_cols = len(panel_rows), len(head_dims)
    width = max(5.0, 0.55 * len(seqlens) * max(len(backends), 2) * 0.5 + 2.0)
    fig = Figure(figsize=(width * n_cols, 4.2 * n_rows + 1.2), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(n_rows, n_cols, squeeze=False)
    counts = {"panels": 0, "bars": 0}
    for i, (direction, dtype, mask) in enumerate(panel_rows):
        for j, head_dim in enumerate(head_dims):
            selected = [r for r in rows if (r["direction"], r["dtype"], r["mask"],
                                            int(r["head_dim"])) == (direction, dtype, mask,
                                                                    head_dim)]
            title = f"{_TITLES.get(direction, direction)}, {mask}, head dim {head_dim} ({dtype})"
            bars = _panel(axes[i][j], selected, backends, seqlens, colours, title)
            counts["panels"] += 1 if selected else 0
            counts["bars"] += bars
    handles = [_legend_patch(colours[b]) for b in backends]
    timed = {r["backend"] for r in rows if r.get("status") == "ok"}
    labels = [b if b in timed else f"{b} (not run)" for b in backends]
    fig.legend(handles, labels, loc="upper center", ncol=min(len(backends), 8),
               frameon=False, bbox_to_anchor=(0.5, 1.0 - 0.15 / (n_rows + 1)))
    fig.suptitle("Attention speed (TFLOP/s, higher is better): " + _subtitle(meta), y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 1.0 - 0.55 / (4.2 * n_rows + 1.2)))
    fig.savefig(path, dpi=dpi)
    return counts


def _legend_patch(colour):
    from matplotlib.patches import Patch

    return Patch(facecolor=colour)


def _panel(ax, rows, backends, seqlens, colours, title) -> int:
    if not rows:
        ax.set_axis_off()
        return 0
    present = [b for b in backends if any(r["backend"] == b for r in rows)]
    values: dict[tuple[str, str], float] = {}
    missing: list[str] = []
    for row in rows:
        if row.get("status") == "ok" and row.get("tflops") is not None:
            values[(row["backend"], seqlen_label(row))] = float(row["tflops"])
    for backend in present:
        if not any(key[0] == backend for key in values):
            missing.append(backend)
    shown = [b for b in present if b not in missing]
    group = 0.8
    bar = group / max(len(shown), 1)
    n_bars = 0
    top = max(values.values()) if values else 1.0
    for k, backend in enumerate(shown):
        for x, label in enumerate(seqlens):
            value = values.get((backend, label))
            pos = x - group / 2 + bar * (k + 0.5)
            if value is None:  # mark the gap so it does not read as a zero
                ax.text(pos, 0, "x", ha="center", va="bottom", fontsize=7, color="#777777")
                continue
            ax.bar(pos, value, bar * 0.95, color=colours[backend])
            ax.text(pos, value + top * 0.01, f"{value:.0f}", ha="center", va="bottom",
                    fontsize=7 if len(shown) <= 4 else 6, rotation=90 if len(shown) > 3 else 0)
            n_bars += 1
    ax.set_xticks(range(len(seqlens)))
    ax.set_xticklabels(seqlens)
    ax.set_xlabel("Sequence length")
    ax.set_ylabel("Speed (TFLOP/s)")
    ax.set_ylim(0, top * 1.22)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    if missing:
        ax.text(0.01, 0.97, "n/a: " + ", ".join(missing), transform=ax.transAxes, ha="left",
                va="top", fontsize=7, color="#555555")
    return n_bars
