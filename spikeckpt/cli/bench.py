"""``spikeckpt bench``: compare training-step strategies; longest sequence / widest network in a budget.

Everything is measured in one process; ratios are to plain BPTT in the same run. See
``docs/benchmarks.md`` for what each column means and the paper claims it reproduces.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from spikeckpt.cli._args import (
    DEVICE_HELP,
    DEVICES,
    Budget,
    budget,
    byte_budget,
    check_device,
    output_folder,
    positive_int,
)
from spikeckpt.errors import ConfigError
from spikeckpt.units import format_bytes

#: ``--quick``: tiny sizes, one repeat (about 15 s on 2 idle cores, most of it start-up).
QUICK = {"T": [16, 48], "batch": 4, "hidden": 16, "inputs": 16, "repeats": 1}


def _density(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _lengths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"cannot parse {text!r} as sequence lengths: write positive integers separated by "
            "commas, e.g. 1000,4000"
        )
    return values


def _strategies(text: str) -> str:
    from spikeckpt.bench import STRATEGY_NAMES  # no torch: checked while parsing

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGY_NAMES and n != "all"]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown strateg{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))};"
            f" valid strategies: {', '.join(STRATEGY_NAMES)} (or 'all')"
        )
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``spikeckpt bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark checkpointing strategies (memory, time, gradients) or search budgets",
        description=(
            "Run one training step of a LIF network per strategy and length: peak device\n"
            "memory (MemoryMeter, parameters included), median time, step evaluations, bytes\n"
            "moved off the device, gradient difference to BPTT. With --max-length or\n"
            "--max-width: the longest sequence or widest network each strategy trains within\n"
            "a device budget. Tables go to the terminal; JSON, CSV, Markdown and a PNG plot\n"
            "to --out. docs/benchmarks.md explains every column."
        ),
        epilog=(
            "examples:\n"
            "  spikeckpt bench --quick                  tiny sizes: a check in about 15 s\n"
            "  spikeckpt bench --T 1000,4000 --budget 5%\n"
            "  spikeckpt bench --max-length 2MiB --strategies bptt,checkpoint,double-disk"
        ),
    )
    parser.add_argument(
        "--T",
        type=_lengths,
        default=None,
        metavar="LENGTHS",
        help="lengths, e.g. 1000,4000 (default: 1000,4000; with --quick 16,48)",
    )
    parser.add_argument(
        "--strategies",
        type=_strategies,
        default=None,
        metavar="NAMES",
        help="comma-separated strategies (default: all but twolevel-async); bptt is always run",
    )
    parser.add_argument(
        "--budget",
        type=budget,
        default=None,
        help=(
            "device budget the planned scan strategies are chosen for, their checkpoints and "
            "tapes alone (wrap(budget=) and MemoryBudget count the whole training step): "
            "bytes (8MiB) or a share of BPTT's modeled peak (5%%); default: the modeled peak "
            "of Uniform(sqrt(T))"
        ),
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--max-length",
        type=byte_budget,
        metavar="BUDGET",
        help="find the largest T per strategy within this device budget (e.g. 4MiB)",
    )
    group.add_argument(
        "--max-width",
        type=byte_budget,
        metavar="BUDGET",
        help="find the largest hidden width per strategy at --T within this device budget",
    )
    parser.add_argument(
        "--cap",
        type=_positive_float,
        default=None,
        help="stop a search at this multiple of BPTT's result (default 128 for length, 8 width)",
    )
    parser.add_argument("--batch", type=positive_int, default=16, help="batch size")
    parser.add_argument("--hidden", type=positive_int, default=128, help="neurons per hidden layer")
    parser.add_argument("--inputs", type=positive_int, default=200, help="input channels")
    parser.add_argument("--layers", type=positive_int, default=2, help="hidden LIF layers")
    parser.add_argument("--density", type=_density, default=0.05, help="input spike probability")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (median)")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads (default: 1 when the machine is busy, else every core)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, one repeat: a check of every strategy in about 15 s (CI)",
    )
    parser.add_argument(
        "--out",
        type=output_folder,
        default="spikeckpt-out",
        metavar="DIR",
        help="folder for the JSON, CSV, Markdown and PNG files (created when they are written)",
    )
    parser.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    parser.set_defaults(handler=run)


class _Steps:
    """What is being measured now: a bar on a terminal that is gone once done (the tables then
    hold every figure once), else one line per item without figures (a log shows progress).

    A context manager: the bar stops (and the cursor comes back) however the block ends.
    """

    def __init__(self, console: Any, total: int) -> None:
        self.console, self.total, self.count = console, total, 0
        self.progress: Any = None
        self.task: Any = None

    def __enter__(self) -> _Steps:
        if self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(
                TextColumn("measuring"),
                BarColumn(bar_width=16),
                MofNCompleteColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=True,
            )
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total)
        return self

    def start(self, what: str) -> None:
        """Say what is measured next."""
        self.count += 1
        if self.progress is not None:
            self.progress.update(self.task, description=what)
        else:
            self.console.print(f"  measuring {what} ({self.count}/{self.total})")

    def done(self) -> None:
        """One item measured."""
        if self.progress is not None:
            self.progress.advance(self.task)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _plan_budget(budget: Budget | None, T: int, S: int, A: int) -> int | None:
    return None if budget is None else budget.resolve(S + T * A)


def run(args: argparse.Namespace) -> int:
    """Run the sweep or the search; print tables and write JSON, CSV, Markdown and PNG."""
    args.started = time.perf_counter()
    args.device = check_device(args.device)
    import torch

    from spikeckpt.bench.measure import calibrate, choose_threads, scratch_directory
    from spikeckpt.bench.strategies import Workload, parse_strategies

    if args.quick:
        for key, value in QUICK.items():
            if key != "T" or args.T is None:
                setattr(args, key, value)
    if args.T is None:
        args.T = [1000, 4000]
    if args.max_width is not None and len(args.T) != 1:
        raise ConfigError("--max-width needs exactly one length: --T 1000")
    strategies = parse_strategies(args.strategies)
    threads, why = choose_threads(args.threads)
    device = torch.device(args.device)
    workload = Workload(args.batch, args.inputs, args.hidden, args.layers, args.density)
    from rich.console import Console

    console = Console(highlight=False)
    console.print(
        f"torch {torch.__version__} on {args.device}, {threads} thread(s) ({why}); "
        f"workload: widths {workload.widths}, batch {workload.batch}, density {workload.density}"
    )
    meta: dict[str, Any] = {
        "command": "spikeckpt bench " + " ".join(sys.argv[2:] if len(sys.argv) > 2 else []),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": args.device,
        "threads": threads,
        "threads_reason": why,
        "workload": vars(workload) | {"widths": workload.widths},
    }
    with scratch_directory() as folder:
        costs = calibrate(workload, folder)
        meta["costs_in_forward_steps"] = vars(costs)
        console.print(
            f"measured costs (unit: one forward step): backward {costs.backward}, "
            f"disk write {costs.write}, disk read {costs.read}, "
            f"per backward call {costs.segment}"
        )
        if args.max_length is not None or args.max_width is not None:
            return _search(args, strategies, workload, costs, folder, device, console, meta)
        return _sweep(args, strategies, workload, costs, folder, device, console, meta)


def _sweep(args, strategies, workload, costs, folder, device, console, meta) -> int:  # type: ignore[no-untyped-def]
    from spikeckpt.bench import report
    from spikeckpt.bench.measure import make_context, measure

    rows = []
    started = time.perf_counter()
    with _Steps(console, len(args.T) * len(strategies)) as steps:
        for T in args.T:
            ctx = make_context(
                workload, T, plan_budget=None, costs=costs, directory=folder, device=device
            )
            ctx.plan_budget = _plan_budget(args.budget, T, ctx.state_bytes, ctx.step_bytes)
            meta.setdefault("sizes", {})[str(T)] = {"S": ctx.state_bytes, "A": ctx.step_bytes}
            reference = None
            base = None
            for strategy in strategies:
                steps.start(f"T={T} {strategy.name}")
                row, grads = measure(strategy, ctx, repeats=args.repeats, reference=reference)
                steps.done()
                if strategy.name == "bptt":
                    reference, base = grads, row
                rows.append(row)
                if base is not None and row.fits and base.peak_bytes and base.time_s:
                    row.peak_ratio = (row.peak_bytes or 0) / base.peak_bytes
                    row.time_ratio = (row.time_s or 0) / base.time_s
    console.print()
    report.print_tables(console, report.sweep_tables(rows, console.width))
    notes = report.sweep_notes(rows)
    if notes:
        console.print("notes:")
        for note in notes:
            console.print(f"- {note}")
        console.print()
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    records = [row.as_dict() for row in rows]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    markdown = out / "bench.md"
    text = report.markdown(report.SWEEP_HEADER, report.sweep_rows(rows))
    markdown.write_text(text + "".join(f"\n- {note}" for note in notes) + ("\n" if notes else ""))
    paths = [
        report.write_json(out / "bench.json", {"meta": meta, "rows": records}),
        report.write_csv(out / "bench.csv", records),
        markdown,
        report.plot_sweep(rows, out / "bench.png"),
    ]
    _announce(console, paths, time.perf_counter() - args.started)
    return 0


def _announce(console: Any, paths: list[Path], seconds: float) -> None:
    what = {".json": "every number", ".csv": "rows", ".md": "Markdown table", ".png": "plot"}
    console.print(f"done in {seconds:.0f} s; wrote:")
    for path in paths:
        console.print(f"  {path}  ({what.get(path.suffix, 'data')})")


def _search(args, strategies, workload, costs, folder, device, console, meta) -> int:  # type: ignore[no-untyped-def]
    from spikeckpt.bench import report
    from spikeckpt.bench.search import max_length, max_width

    length = args.max_length is not None
    budget = args.max_length if length else args.max_width
    cap_ratio = args.cap or (128.0 if length else 8.0)
    if args.quick and args.cap is None:
        cap_ratio = 16.0 if length else 4.0
    quantity = "T" if length else "hidden"
    results = []
    base = 0
    started = time.perf_counter()
    skipped = []
    with _Steps(console, len(strategies)) as steps:
        for strategy in strategies:
            if not strategy.available:
                skipped.append(f"{strategy.name}: {strategy.note}")
                continue
            steps.start(f"the largest {quantity} of {strategy.name}")
            start = base or 8
            cap = max(start, math.ceil(cap_ratio * base)) if base else 1 << 20
            if length:
                result = max_length(
                    strategy, workload, budget, costs, folder, start=start, cap=cap, device=device
                )
            else:
                result = max_width(
                    strategy,
                    workload,
                    args.T[0],
                    budget,
                    costs,
                    folder,
                    start=start,
                    cap=cap,
                    device=device,
                )
            steps.done()
            if strategy.name == "bptt":
                base = result.best
                if base == 0:
                    raise ConfigError(
                        f"BPTT fits no {quantity} within {format_bytes(budget)}; raise the budget"
                    )
            results.append(result)
    for line in skipped:
        console.print(f"  {line}")
    what = "max-length" if length else "max-width"
    title = f"{what}: device budget {format_bytes(budget)}" + ("" if length else f", T={args.T[0]}")
    console.print()
    report.print_tables(console, report.search_tables(results, title, console.width))
    meta["wall_s"] = round(time.perf_counter() - started, 1)
    meta["budget_bytes"] = budget
    meta["cap_ratio"] = cap_ratio
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = [r.as_dict() for r in results]
    flat = [
        {k: v for k, v in r.items() if k not in ("trials", "best_row")}
        | {"plan": r["best_row"]["plan"] if r["best_row"] else None}
        | {"peak_bytes": r["best_row"]["peak_bytes"] if r["best_row"] else None}
        for r in records
    ]
    markdown = out / f"{what}.md"
    markdown.write_text(report.markdown(report.SEARCH_HEADER, report.search_rows(results)))
    paths = [
        report.write_json(out / f"{what}.json", {"meta": meta, "results": records}),
        report.write_csv(out / f"{what}.csv", flat),
        markdown,
        report.plot_search(results, out / f"{what}.png", title),
    ]
    _announce(console, paths, time.perf_counter() - args.started)
    return 0
