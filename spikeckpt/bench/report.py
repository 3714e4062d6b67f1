"""Tables (rich), JSON, CSV, Markdown and PNG plots (matplotlib, Agg) of benchmark results.

Console tables fit the terminal: one table per length, and when that is too wide for the
terminal (80 columns, say) the columns are split over two tables that both repeat the strategy
and its plan. A plan is always shown whole, as its ``repr``; a long one (a ``TwoLevel`` with
its measured costs) wraps between its arguments, never cut. The Markdown table keeps every
column. Notes below the tables say where a measured peak exceeds the row's budget, and why.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spikeckpt.bench.measure import Measurement
from spikeckpt.bench.search import SearchResult
from spikeckpt.units import format_bytes

__all__ = [
    "markdown",
    "plot_search",
    "fitting_tables",
    "plot_sweep",
    "print_tables",
    "sweep_figure",
    "search_table",
    "search_tables",
    "sweep_notes",
    "sweep_table",
    "sweep_tables",
    "write_csv",
    "write_json",
]


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def sweep_rows(rows: Sequence[Measurement]) -> list[list[str]]:
    """Table cells for a sweep: one row per strategy and length."""
    cells = []
    for r in rows:
        status = (
            r.plan if r.fits else ("not available" if r.note.startswith("not av") else "no fit")
        )
        cells.append(
            [
                str(r.T),
                str(r.hidden),
                r.label,
                status,
                _bytes(r.budget_bytes),
                _bytes(r.modeled_bytes),
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
    "budget",
    "modeled",
    "peak",
    "peak/BPTT",
    "time s",
    "time/BPTT",
    "evals/step",
    "off-device",
    "rel |dg|",
]


#: Widest plan column in a console table: ``Double(remote_interval=64, local_interval=8)``
#: fits on one line; a longer plan wraps at the spaces between its arguments.
PLAN_WIDTH = 46


def _rich_table(title: str, header: list[str], cells: list[list[str]]) -> Any:
    """A compact table: text columns left, numbers right, no cell ever wrapped."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in header:
        if name in ("plan", "plan at max"):  # whole; a long one wraps between its arguments
            table.add_column(name, justify="left", max_width=PLAN_WIDTH)
        else:
            table.add_column(name, justify="left" if name == "strategy" else "right", no_wrap=True)
    for row in cells:
        table.add_row(*row)
    return table


def fitting_tables(
    title: str, header: list[str], cells: list[list[str]], keys: int, width: int | None
) -> list[Any]:
    """One table, or when it is wider than ``width`` the columns split over several tables.

    The first ``keys`` columns (strategy, plan) are repeated in each table.
    """
    table = _rich_table(title, header, cells)
    if width is None or _natural_width(table) <= width:
        return [table]
    rest = list(range(keys, len(header)))
    groups: list[list[int]] = [[]]
    for column in rest:
        trial = [*range(keys), *groups[-1], column]
        if groups[-1] and _natural_width(_subtable(title, header, cells, trial)) > width:
            groups.append([])
        groups[-1].append(column)
    return [
        _subtable(f"{title} ({i}/{len(groups)})", header, cells, [*range(keys), *group])
        for i, group in enumerate(groups, 1)
    ]


def _subtable(title: str, header: list[str], cells: list[list[str]], columns: list[int]) -> Any:
    return _rich_table(
        title, [header[c] for c in columns], [[r[c] for c in columns] for r in cells]
    )


def _natural_width(table: Any) -> int:
    from rich.console import Console
    from rich.measure import Measurement

    console = Console(width=10_000)
    return Measurement.get(console, console.options, table).maximum


def print_tables(console: Any, tables: Sequence[Any]) -> None:
    """Print tables to a ``rich`` console, a blank line after each."""
    for table in tables:
        console.print(table)
        console.print()


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|")


def markdown(header: list[str], cells: list[list[str]]) -> str:
    """A Markdown table of the same cells (for the docs); pipes inside cells are escaped."""
    lines = ["| " + " | ".join(map(_escape, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(_escape, row)) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def sweep_table(rows: Sequence[Measurement], title: str = "spikeckpt bench") -> Any:
    """A ``rich`` table of a sweep, every column (as in ``bench.md``)."""
    return _rich_table(title, SWEEP_HEADER, sweep_rows(rows))


#: Console columns of a sweep (per length): the strategy's command-line name, then the cells.
CONSOLE_HEADER = [
    "strategy",
    "plan",
    "budget",
    "modeled",
    "peak",
    "peak/BPTT",
    "time s",
    "time/BPTT",
    "evals/step",
    "off-device",
    "rel |dg|",
]


def over_budget(rows: Sequence[Measurement]) -> str | None:
    """One note on the rows whose measured peak exceeds the row's budget: by how much, and
    why; None when every peak is within its budget."""
    over = [
        f"T={r.T} {r.strategy} +{format_bytes(r.peak_bytes - r.budget_bytes)}"
        for r in rows
        if r.fits
        and r.budget_bytes is not None
        and r.peak_bytes is not None
        and r.peak_bytes > r.budget_bytes
    ]
    if not over:
        return None
    return (
        f"measured peak over the row's budget: {', '.join(over)}. The budget bounds what the "
        "plan models (the modeled column: checkpoints and tapes, plus the parameters and their "
        "gradients); a step also holds what no plan models: one step's temporaries and the "
        "gradient buffers the engine sums segments into"
    )


def sweep_notes(rows: Sequence[Measurement]) -> list[str]:
    """Notes for below a sweep's tables: peaks over their budget (and why), then each
    strategy's caveat once (e.g. a Double that keeps no remote checkpoint)."""
    notes = [note] if (note := over_budget(rows)) else []
    by_note: dict[str, list[str]] = {}
    for row in rows:
        if row.note and row.fits:
            by_note.setdefault(row.note, []).append(row.strategy)
    notes += [f"{', '.join(dict.fromkeys(names))}: {text}" for text, names in by_note.items()]
    return notes


def sweep_tables(rows: Sequence[Measurement], width: int | None = None) -> list[Any]:
    """``rich`` tables of a sweep for a console ``width`` columns wide: one or more per length."""
    tables = []
    for T in dict.fromkeys(r.T for r in rows):
        mine = [r for r in rows if r.T == T]
        first = mine[0]
        title = f"T = {T} steps (hidden {first.hidden}, batch {first.batch})"
        cells = [[r.strategy, *cell[3:]] for r, cell in zip(mine, sweep_rows(mine), strict=True)]
        tables += fitting_tables(title, CONSOLE_HEADER, cells, keys=1, width=width)
    return tables


SEARCH_HEADER = ["strategy", "budget", "max", "max/BPTT", "plan at max", "peak at max", "trials"]


def search_rows(results: Sequence[SearchResult]) -> list[list[str]]:
    """Table cells for a search: one row per strategy."""
    base = next((r.best for r in results if r.strategy == "bptt"), 0)
    cells = []
    for r in results:
        best = f"{r.quantity} >= {r.best}" if r.capped else f"{r.quantity}={r.best}"
        ratio = "-" if not base else (">= " if r.capped else "") + f"{r.best / base:.1f}"
        row = r.best_row
        cells.append(
            [
                r.strategy,
                format_bytes(r.budget_bytes),
                best,
                ratio,
                row.plan if row else "-",
                _bytes(row.peak_bytes if row else None),
                str(len(r.trials)),
            ]
        )
    return cells


def search_table(results: Sequence[SearchResult], title: str) -> Any:
    """A ``rich`` table of a max-length or max-width search."""
    return _rich_table(title, SEARCH_HEADER, search_rows(results))


def search_tables(
    results: Sequence[SearchResult], title: str, width: int | None = None
) -> list[Any]:
    """``rich`` tables of a search for a console ``width`` columns wide (the budget in the title)."""
    header = [h for h in SEARCH_HEADER if h != "budget"]
    cells = [[c for i, c in enumerate(row) if i != 1] for row in search_rows(results)]
    order = [0, header.index("plan at max")] + [
        i for i in range(1, len(header)) if header[i] != "plan at max"
    ]
    header = [header[i] for i in order]
    cells = [[row[i] for i in order] for row in cells]
    return fitting_tables(title, header, cells, keys=1, width=width)


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


#: One look per strategy: (colour, marker, line style). No two share a colour and a marker;
#: BPTT, the reference, is a black dashed line drawn on top of everything else.
STYLES: dict[str, tuple[str, str, str]] = {
    "bptt": ("black", "o", "--"),
    "checkpoint": ("tab:orange", "v", "-"),
    "save_on_cpu": ("#c8c8c8", "s", "-"),
    "uniform-sqrt": ("tab:green", "^", "-"),
    "uniform": ("tab:olive", "<", "-"),
    "revolve": ("tab:purple", ">", "-"),
    "double-host": ("tab:red", "D", "-"),
    "double-disk": ("tab:brown", "d", "-"),
    "twolevel": ("tab:pink", "P", "-"),
    "twolevel-async": ("tab:cyan", "X", "-"),
    "layerwise": ("tab:blue", "*", "-"),
    "layerwise-disk": ("navy", "h", ":"),
}

_BYTE_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit in which ``largest`` bytes reads as a number from 1 to 1023."""
    name, scale = _BYTE_UNITS[0]
    for name_, scale_ in _BYTE_UNITS:
        if largest >= scale_:
            name, scale = name_, scale_
    return name, scale


def _plain_log_axis(axis: Any, values: Sequence[float], fixed: bool = False) -> None:
    """A log axis labelled with plain numbers (10, 20, 50, ...), not powers of ten.

    ``fixed``: a tick at each value (the lengths); otherwise ticks at 1-2-5 steps, denser when
    the values span less than two decades.
    """
    from matplotlib import ticker

    if fixed:
        axis.set_major_locator(ticker.FixedLocator(sorted(set(values))))
    else:
        positive = [v for v in values if v > 0] or [1.0]
        decades = math.log10(max(positive) / min(positive))
        subs = (
            (1.0, 2.0, 3.0, 5.0, 7.0) if decades < 2 else (1.0, 2.0, 5.0) if decades < 4 else (1.0,)
        )
        axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


#: Sideways spread of a length's points in ``plot_sweep``, in decades of T, over all series.
DODGE_DECADES = 0.15


def plot_sweep(rows: Sequence[Measurement], path: Path) -> Path:
    """Save `sweep_figure` as a PNG at ``path``; returns ``path``."""
    plt = _pyplot()
    fig = sweep_figure(rows)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_figure(rows: Sequence[Measurement]) -> Any:
    """Peak device memory and time per training step against T, one line per strategy.

    Memory is in the binary unit that suits the largest peak; the legend sits beside the
    plots. Strategies often measure the same (several plans are one schedule at small T): so
    that no series hides another, each has its own marker and its points are moved sideways
    by a small factor of T (the ticks mark the true lengths).
    """
    plt = _pyplot()
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(12, 4.6), layout="constrained")
    ran = [r for r in rows if r.fits]
    unit, scale = byte_unit(max((r.peak_bytes or 0 for r in ran), default=1))
    names = list(dict.fromkeys(r.strategy for r in ran))
    count = len(names)
    names.sort(key=lambda name: name == "bptt")  # the reference last: drawn on top
    order = list(dict.fromkeys(r.strategy for r in ran))  # sideways order: as measured
    for name in names:
        mine = sorted((r for r in ran if r.strategy == name), key=lambda r: r.T)
        colour, marker, line = STYLES.get(name, ("grey", "o", "-"))
        reference = name == "bptt"
        style = {
            "color": colour,
            "marker": marker,
            "linestyle": line,
            "label": mine[0].label,
            "linewidth": 2.0 if reference else 1.2,
            "markersize": 8 if reference else 5,
            "markerfacecolor": "none" if reference else colour,
            "markeredgewidth": 1.5 if reference else 0.8,
            "alpha": 1.0 if reference else 0.9,
            "zorder": 10 if reference else 2,
        }
        shift = 0.0 if count < 2 else (order.index(name) / (count - 1) - 0.5) * DODGE_DECADES
        Ts = [r.T * 10**shift for r in mine]
        ax_mem.plot(Ts, [(r.peak_bytes or 0) / scale for r in mine], **style)
        ax_time.plot(Ts, [r.time_s or 0 for r in mine], **style)
    lengths = [r.T for r in ran]
    for ax, ylabel, values in (
        (
            ax_mem,
            f"peak device memory, measured ({unit})",
            [(r.peak_bytes or 0) / scale for r in ran],
        ),
        (ax_time, "time per training step, measured (s)", [r.time_s or 0 for r in ran]),
    ):
        ax.set_xlabel("sequence length T (steps; each length's points spread sideways)")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis, lengths, fixed=True)
        _plain_log_axis(ax.yaxis, values)
        if lengths:
            low, high = min(lengths), max(lengths)
            ax.set_xlim(low / 10 ** (0.8 * DODGE_DECADES), high * 10 ** (0.8 * DODGE_DECADES))
        ax.grid(True, which="major", alpha=0.3)
    handles, labels = ax_mem.get_legend_handles_labels()
    order_in_legend = sorted(range(len(labels)), key=lambda i: labels[i] != "BPTT loop")
    fig.legend(
        [handles[i] for i in order_in_legend],
        [labels[i] for i in order_in_legend],
        loc="outside right center",
        fontsize=8,
        frameon=False,
    )
    return fig


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
