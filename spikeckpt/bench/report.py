"""Tables (rich), JSON, CSV and PNG plots (matplotlib, Agg backend) of benchmark results."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spikeckpt.bench.measure import Measurement
from spikeckpt.bench.search import SearchResult
from spikeckpt.units import format_bytes

__all__ = [
    "plot_search",
    "plot_sweep",
    "search_table",
    "sweep_table",
    "write_csv",
    "write_json",
]


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def short_plan(text: str) -> str:
    """A compact plan description: ``Double(remote_interval=64, local_interval=8)`` -> ``Double(K=64, k=8)``."""
    for long, short in (
        ("remote_interval=", "K="),
        ("local_interval=", "k="),
        ("interval=", "k="),
        ("write_cost=", "w="),
        ("read_cost=", "r="),
        ("forward_cost=", "f="),
        ("backward_cost=", "b="),
    ):
        text = text.replace(long, short)
    return text


def sweep_rows(rows: Sequence[Measurement]) -> list[list[str]]:
    """Table cells for a sweep: one row per strategy and length."""
    cells = []
    for r in rows:
        status = (
            short_plan(r.plan)
            if r.fits
            else ("not available" if r.note.startswith("not av") else "no fit")
        )
        cells.append(
            [
                str(r.T),
                str(r.hidden),
                r.label,
                status[:60],
                _bytes(r.peak_bytes),
                _num(r.peak_ratio, ".3f"),
                _num(r.time_s, ".3f"),
                _num(r.time_ratio, ".2f"),
                _num(r.evals_per_step, ".2f"),
                _bytes(r.bytes_off_device),
                _num(r.max_rel_grad_diff, ".1e"),
            ]
        )
    return cells


SWEEP_HEADER = [
    "T",
    "hidden",
    "strategy",
    "plan",
    "peak",
    "peak/BPTT",
    "time s",
    "time/BPTT",
    "evals/step",
    "off-device",
    "rel |dg|",
]


def _rich_table(title: str, header: list[str], cells: list[list[str]]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i in (2, 3) or name == "strategy" else "right")
    for row in cells:
        table.add_row(*row)
    return table


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A Markdown table of the same cells (for the docs)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in cells]
    return "\n".join(lines)


def sweep_table(rows: Sequence[Measurement], title: str = "spikeckpt bench") -> Any:
    """A ``rich`` table of a sweep."""
    return _rich_table(title, SWEEP_HEADER, sweep_rows(rows))


SEARCH_HEADER = ["strategy", "budget", "max", "x BPTT", "plan at max", "peak at max", "trials"]


def search_rows(results: Sequence[SearchResult]) -> list[list[str]]:
    """Table cells for a search: one row per strategy."""
    base = next((r.best for r in results if r.strategy == "bptt"), 0)
    cells = []
    for r in results:
        best = f">= {r.best}" if r.capped else str(r.best)
        ratio = "-" if not base else (">= " if r.capped else "") + f"{r.best / base:.1f}"
        row = r.best_row
        cells.append(
            [
                r.strategy,
                format_bytes(r.budget_bytes),
                f"{r.quantity}={best}",
                ratio,
                short_plan(row.plan if row else "-")[:60],
                _bytes(row.peak_bytes if row else None),
                str(len(r.trials)),
            ]
        )
    return cells


def search_table(results: Sequence[SearchResult], title: str) -> Any:
    """A ``rich`` table of a max-length or max-width search."""
    return _rich_table(title, SEARCH_HEADER, search_rows(results))


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON; returns the path."""
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def write_csv(path: Path, records: Sequence[dict[str, Any]]) -> Path:
    """Write flat records (dicts with the same keys) as CSV; returns the path."""
    keys: list[str] = []
    for record in records:
        keys += [k for k in record if k not in keys]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        for record in records:
            writer.writerow({k: v for k, v in record.items() if not isinstance(v, (list, dict))})
    return path


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(rows: Sequence[Measurement], path: Path) -> Path:
    """Peak device memory (MiB) and time per training step (s) against T, one line per strategy."""
    plt = _pyplot()
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(dict.fromkeys(r.label for r in rows if r.fits))
    for label in labels:
        mine = sorted((r for r in rows if r.label == label and r.fits), key=lambda r: r.T)
        Ts = [r.T for r in mine]
        ax_mem.plot(Ts, [(r.peak_bytes or 0) / 2**20 for r in mine], "o-", label=label)
        ax_time.plot(Ts, [r.time_s or 0 for r in mine], "o-", label=label)
    for ax, ylabel in ((ax_mem, "peak device memory (MiB)"), (ax_time, "time per step (s)")):
        ax.set_xlabel("sequence length T (steps)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_search(results: Sequence[SearchResult], path: Path, title: str) -> Path:
    """Bar chart of the largest size per strategy (hatched when the search hit its cap)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r.strategy for r in results]
    bars = ax.bar(names, [max(r.best, 1) for r in results], color="tab:blue")
    for bar, r in zip(bars, results, strict=True):
        if r.capped:
            bar.set_hatch("//")
        ax.annotate(
            (">=" if r.capped else "") + str(r.best),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    quantity = results[0].quantity if results else "T"
    ax.set_ylabel("largest T (steps)" if quantity == "T" else "largest hidden width")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
