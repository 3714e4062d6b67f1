"""``spikeckpt bench``: the quick sweep, its outputs, exact gradients, clear errors, the search."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spikeckpt.bench import report
from spikeckpt.bench.measure import Measurement, calibrate, scratch_directory
from spikeckpt.bench.search import max_length
from spikeckpt.bench.strategies import STRATEGIES, Workload, available, parse_strategies
from spikeckpt.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """``bench --quick``: the output folder, ``bench.md`` and what the command printed."""
    out = tmp_path_factory.mktemp("bench")
    torch_threads = torch.get_num_threads()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            code = main(["bench", "--quick", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(torch_threads)
    assert code == 0
    return out, (out / "bench.md").read_text(), printed.getvalue()


def test_quick_writes_json_csv_and_png(quick_run: tuple[Path, str, str]) -> None:
    out, _, _ = quick_run
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["threads"] == 1
    assert {row["T"] for row in data["rows"]} == {16, 48}
    csv_lines = (out / "bench.csv").read_text().splitlines()
    assert csv_lines[0].startswith("strategy,label,T,")
    assert len(csv_lines) == 1 + len(data["rows"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_every_available_strategy(quick_run: tuple[Path, str, str]) -> None:
    _, table, _ = quick_run
    for name in available():
        if name == "twolevel-async":
            continue  # Kukreja's scheme runs only when asked for
        assert STRATEGIES[name].label in table, name
    assert "layer-wise host" in table and "layer-wise disk" in table


def test_gradients_match_bptt_to_round_off(quick_run: tuple[Path, str, str]) -> None:
    out, _, _ = quick_run
    rows = json.loads((out / "bench.json").read_text())["rows"]
    ran = [r for r in rows if r["fits"] and r["strategy"] != "bptt"]
    assert len(ran) >= 8
    for row in ran:
        assert row["max_rel_grad_diff"] <= 1e-5, row
        assert row["peak_bytes"] > 0 and row["time_s"] > 0 and row["evals_per_step"] >= 1


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row: split on pipes that are not escaped."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_markdown_is_a_table_with_equal_cell_counts(quick_run: tuple[Path, str, str]) -> None:
    out, markdown, printed = quick_run
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(json.loads((out / "bench.json").read_text())["rows"])
    notes = markdown.splitlines()[len(lines) :]  # a blank line, then the notes as a list
    assert all(line.startswith("- ") for line in notes[1:]) and notes[:1] in ([], [""])
    counts = {len(_cells(line)) for line in lines}
    assert counts == {len(report.SWEEP_HEADER)}, counts
    assert set(_cells(lines[1])) == {"---"}
    assert r"rel \|dg\|" in lines[0]
    for name in ("bench.md", "bench.json", "bench.csv", "bench.png"):
        assert str(out / name) in printed, name  # every file written is announced


def test_console_tables_fit_80_columns_with_whole_plan_names(
    quick_run: tuple[Path, str, str],
) -> None:
    from rich.console import Console

    out, _, _ = quick_run
    rows = [Measurement(**row) for row in json.loads((out / "bench.json").read_text())["rows"]]
    long = Measurement(**{**vars(rows[-1]), "T": 99999, "strategy": "twolevel"})
    long.plan = "TwoLevel(slots=64, write_cost=12.345, read_cost=23.456, backward_cost=2.109)"
    rows.append(long)
    console = Console(width=80, record=True, file=io.StringIO())
    report.print_tables(console, report.sweep_tables(rows, console.width))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "…" not in text
    lines = text.splitlines()
    for row in rows:
        if len(row.plan) <= report.PLAN_WIDTH:  # on the strategy's line, whole
            assert any(line.startswith(f"{row.strategy} ") and row.plan in line for line in lines)
    # a longer plan wraps between its arguments: every argument is there, none cut
    first = next(i for i, line in enumerate(lines) if "TwoLevel(slots=64," in line)
    assert "write_cost=12.345," in lines[first]
    assert "read_cost=23.456, backward_cost=2.109)" in lines[first + 1]
    assert "T = 99999 steps" in text
    for column in ("peak", "peak/BPTT", "time/BPTT", "rel |dg|"):  # every column, named so
        assert column in text, column
    assert "x BPTT" not in text


def test_plot_styles_are_distinct_and_units_readable() -> None:
    assert set(STRATEGIES) <= set(report.STYLES)
    looks = [(colour, marker) for colour, marker, _ in report.STYLES.values()]
    assert len(set(looks)) == len(looks)
    assert len({colour for colour, _ in looks}) == len(looks)
    assert report.byte_unit(40 * 1024) == ("KiB", 1024)
    assert report.byte_unit(3 * 2**20) == ("MiB", 2**20)
    assert report.byte_unit(500) == ("B", 1)


def test_unknown_strategy_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--strategies", "bptt,magic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown strategy 'magic'" in err
    assert "double-disk" in err and "checkpoint" in err


@pytest.mark.parametrize("flag", ["--budget", "--max-length"])
def test_unparseable_budget_is_a_clear_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", flag, "lots"])
    assert exit_info.value.code == 2
    assert "cannot parse budget 'lots'" in capsys.readouterr().err


def test_parse_strategies_always_runs_bptt_first() -> None:
    names = [s.name for s in parse_strategies("double-disk,uniform")]
    assert names == ["bptt", "double-disk", "uniform"]


def test_max_length_double_disk_beats_bptt(tmp_path: Path) -> None:
    workload = Workload(batch=2, inputs=8, hidden=16, layers=1)
    budget = 24 * 1024
    with scratch_directory(str(tmp_path)) as folder:
        costs = calibrate(workload, folder, steps=16)
        bptt = max_length(STRATEGIES["bptt"], workload, budget, costs, folder, start=8, cap=256)
        assert 0 < bptt.best < 256 and not bptt.capped
        double = max_length(
            STRATEGIES["double-disk"], workload, budget, costs, folder, start=bptt.best,
            cap=4 * bptt.best,
        )  # fmt: skip
    assert double.best > bptt.best
    assert double.best_row is not None and double.best_row.peak_bytes is not None
    assert double.best_row.peak_bytes <= budget
    row = double.best_row  # a Double, or named for what it is when it keeps no remote checkpoint
    assert "Double" in row.plan or (
        "keeps no remote checkpoint" in row.note and "Uniform(" in row.plan
    )
    assert math.isfinite(double.best / bptt.best)


def test_strategy_names_are_known_without_torch() -> None:
    from spikeckpt.bench import STRATEGY_NAMES

    assert tuple(STRATEGIES) == STRATEGY_NAMES  # what --strategies checks while parsing


def _row(
    strategy: str, T: int, peak: int, budget: int | None = None, **extra: object
) -> Measurement:
    return Measurement(
        strategy, strategy, T, 16, 4, "Uniform(interval=4)", True, peak_bytes=peak,
        budget_bytes=budget, modeled_bytes=extra.pop("modeled", None), **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_peak_over_its_budget_gets_a_note_that_says_why() -> None:
    rows = [
        _row("bptt", 48, 67 * 1024),
        _row("uniform", 48, 29 * 1024, 24 * 1024, modeled=23 * 1024),
        _row("revolve", 48, 20 * 1024, 24 * 1024, modeled=19 * 1024),
        _row("double-host", 16, 21 * 1024, 24 * 1024, note="at T=16 ... it is Uniform(interval=8)"),
        _row("double-disk", 16, 21 * 1024, 24 * 1024, note="at T=16 ... it is Uniform(interval=8)"),
    ]
    notes = report.sweep_notes(rows)
    assert notes[0].startswith("measured peak over the row's budget: T=48 uniform +5.00 KiB.")
    assert "revolve" not in notes[0]  # within its budget
    assert "checkpoints and tapes" in notes[0] and "gradient buffers" in notes[0]  # why
    assert notes[1] == "double-host, double-disk: at T=16 ... it is Uniform(interval=8)"
    assert report.sweep_notes(rows[:1]) == []


def test_quick_run_prints_its_notes(quick_run: tuple[Path, str, str]) -> None:
    _, markdown, printed = quick_run
    assert "notes:" in printed and "save_on_cpu: on a CPU-only machine" in printed
    assert "- save_on_cpu: on a CPU-only machine" in markdown
    for line in printed.splitlines():  # the figures are in the tables, once
        assert not line.strip().startswith("T=16 bptt:"), line


def test_plot_shows_every_series_where_they_coincide() -> None:
    names = ["bptt", "uniform-sqrt", "uniform", "revolve", "double-host", "double-disk"]
    rows = [
        _row(name, T, (67 if name == "bptt" else 25) * 1024, time_s=0.01)
        for T in (16, 48)
        for name in names
    ]  # five strategies with the very same figures
    figure = report.sweep_figure(rows)
    memory = figure.axes[0]
    points = {
        (x, y)
        for line in memory.lines
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)
    }
    assert len(points) == len(rows)  # no point hides another
    markers = {line.get_marker() for line in memory.lines}
    assert len(markers) == len(names)
    for line in memory.lines:  # each point stays near its length (within 20%)
        for x, T in zip(line.get_xdata(), (16, 48), strict=True):
            assert abs(x / T - 1) < 0.2
    labels = [text.get_text() for text in figure.legends[0].get_texts()]
    assert len(labels) == len(names)


# ------------------------------------------------------------------ benchmarks/bench_peers.py


def _benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (benchmarks/ is not a package)."""
    import sys

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _bench_peers() -> Any:
    return _benchmark("bench_peers")


def _run_peers(tmp_path: Path, *extra: str) -> tuple[list[dict[str, Any]], str]:
    pytest.importorskip("snntorch")
    module = _bench_peers()
    out, data = tmp_path / "peers.md", tmp_path / "peers.json"
    argv = ["--n", "32", "--T", "20", "--repeats", "1", "--warmup", "0", "--share", "100"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = module.main([*argv, *extra, "--out", str(out), "--json", str(data)])
    assert code == 0
    assert str(out) in printed.getvalue() and str(data) in printed.getvalue()
    return json.loads(data.read_text()), out.read_text()


def _check_peers_rows(rows: list[dict[str, Any]], table: str) -> None:
    ran = [r for r in rows if "skipped" not in r]
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len(lines) == 2 + len(ran)  # header, rule, one line per row that ran
    assert len({len(_cells(line)) for line in lines}) == 1
    for row in ran:
        assert row["peak_bytes"] > 0 and min(row["times_s"]) > 0 and row["first_call_s"] > 0
        assert f"| 32 | {row['row']} |" in table
        if row["same_model"] and row["row"] != "snnTorch loop":
            assert row["grad_rel"] is not None and row["grad_rel"] <= 1e-5, row
        if "at 100%" in row["row"]:  # the budget rows: their peak within the budget given
            assert 0 < row["peak_bytes"] <= row["budget_bytes"], row
    for row in rows:
        if "skipped" in row:
            assert row["skipped"] and f"{row['row']}: skipped: " in table  # with the reason


def test_bench_peers_runs_every_row_and_matches_the_loop(tmp_path: Path) -> None:
    """The peers' benchmark on tiny sizes, compiled rows left out (``--skip compile``): every
    row there is measured or listed with its reason; spikeckpt's gradients are the loop's."""
    rows, table = _run_peers(tmp_path, "--skip", "compile")
    _check_peers_rows(rows, table)
    names = {r["row"] for r in rows if "skipped" not in r}
    expected = {
        "snnTorch loop",
        "spikeckpt stack, BPTT()",
        "spikeckpt stack, plan=auto at 100%",
        "spikeckpt auto at 100%",
        "spikeckpt layer-wise, chunk 25, per-step neuron",
        "spikeckpt layer-wise, chunk 25, fused, exact",
    }
    assert expected <= names, names
    if importlib.util.find_spec("norse") is not None:
        assert "Norse SequentialState(Linear, LIF), eager" in names
    assert not any("compile" in name for name in names)
    every = {r["row"] for r in rows}
    assert "spikeckpt layer-wise, chunk 25, fused, eager" in every  # ran, or skipped with why


def test_bench_peers_flags_a_row_over_its_budget() -> None:
    """A budget row whose peak is over its budget says so in the table (the GPU's n = 8192
    row at 40% held 1.08x its budget, and only arithmetic on the table showed it)."""
    module = _bench_peers()

    def row(peak: int) -> Any:
        weight = nn.Parameter(torch.zeros(1))
        found = module.Row("spikeckpt auto at 10%", lambda: None, [weight], weight)
        found.peak, found.budget, found.plan = peak, 1000, "layer-wise(chunk=9)"
        return found

    over, within = module.table(32, [row(1100), row(1000)])
    assert "layer-wise(chunk=9), **1.10x its budget**" in over
    assert "its budget" not in within and row(1000).over_budget is False


@pytest.mark.slow
def test_bench_peers_compiled_rows_run_compiled(tmp_path: Path) -> None:
    """The compiled rows (Norse's compiled cell; spikeckpt's once ``wrap`` has ``compile=``)
    run and are measured with the allocator meter; spikeckpt's gradients are the loop's."""
    pytest.importorskip("norse")
    rows, table = _run_peers(tmp_path, "--only", "compile")
    _check_peers_rows(rows, table)
    names = {r["row"] for r in rows if "skipped" not in r}
    assert {"snnTorch loop", "Norse LIFCell, torch.compile, stepped"} <= names, names


def test_bench_recurrent_rows_do_not_plan_in_timed_calls(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``bench_recurrent.py`` with a budget (the path a GPU takes: ``plan="auto"`` plans to the
    free memory there): no row plans again in a timed call (the fused row after the model's
    own loop did, 0.115 s of probes in a 0.121 s call here, 1.0 s on an H200), so it exits 0."""
    pytest.importorskip("snntorch")
    threads = torch.get_num_threads()
    try:
        argv = ["--T", "20", "--hidden", "16", "--batch", "2", "--rounds", "1"]
        code = _benchmark("bench_recurrent").main([*argv, "--only", "RLeaky", "--budget", "1GiB"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| RLeaky | layer-wise, fused |" in out and "planned again" not in out
    assert code == 0


def test_bench_exact_prints_the_exact_run_bitwise(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench_exact.py`` (step 6 of the GPU suite) at a small T: its table has every run, and
    ``exact=True`` and the stack plan match the loop's spikes exactly."""
    pytest.importorskip("snntorch")
    threads = torch.get_num_threads()
    try:
        _benchmark("bench_exact").main(["--T", "60", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = [
        line.split(" | ") for line in out.splitlines() if line.startswith("| ") and " s | " in line
    ]
    table = {cells[0].strip("| "): cells for cells in rows}
    assert set(table) == {
        "snnTorch loop", "stack, BPTT()", "layer-wise, chunk 25",
        "layer-wise, chunk 25, exact=True", "layer-wise, chunk 25, fuse=False",
    }, table  # fmt: skip
    for row in ("stack, BPTT()", "layer-wise, chunk 25, exact=True"):
        assert table[row][1] == "0", table[row]  # output spikes differing from the loop's
    assert "outputs differ" in out


def test_profile_layerwise_prints_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    """``profile_layerwise.py`` (step 7 of the GPU suite) at a small size: a profile of each
    run (the loop, layer-wise, stack ``BPTT()``), the host's waits for the device and its value
    reads apart, and the ratios of the times to the loop's."""
    pytest.importorskip("snntorch")
    threads = torch.get_num_threads()
    try:
        _benchmark("profile_layerwise").main(["--n", "64", "--T", "30", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "## snnTorch loop: " in out and "## layer-wise fused, chunk 25: " in out
    assert "## stack BPTT(): " in out
    assert out.count("device synchronizations and copies:") == 3
    assert out.count("value reads (of host or device tensors):") == 3
    # the wrapped runs reuse their plan in the profiled call (planned in the untimed first)
    planning = re.findall(r"planning inside the call: (\S+) s", out)
    assert len(planning) == 2 and all(float(p) < 1e-2 for p in planning), planning
    # layer-wise reads host values (the index train's offsets): listed, not called waits
    layer = out.split("## layer-wise fused")[1].split("## stack")[0]
    assert "value reads (of host or device tensors): {'aten::item'" in layer
    assert re.search(r"layer-wise / loop: \d+\.\d\d", out)
    assert re.search(r"stack BPTT\(\) / loop: \d+\.\d\d", out)


# ------------------------------------------------------------------ every benchmark's --help

BENCHMARK_SCRIPTS = sorted(
    p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
)


@pytest.mark.parametrize("name", BENCHMARK_SCRIPTS)
def test_every_benchmark_script_prints_its_help(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python benchmarks/<name>.py --help`` exits 0 with a usage line (a bare ``%`` in an
    option's help made argparse raise a TypeError there)."""
    pytest.importorskip("snntorch")
    pytest.importorskip("norse")
    module = _benchmark(name)
    monkeypatch.setattr("sys.argv", [f"{name}.py", "--help"])
    takes_argv = bool(inspect.signature(module.main).parameters)
    with pytest.raises(SystemExit) as exit_:
        if takes_argv:
            module.main(["--help"])
        else:
            module.main()
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_bench_conv_rows_match_the_loops_gradient(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench_conv.py`` on two of its models, small: every row's first convolution's
    gradient within round-off of the model's own loop's (its last column)."""
    threads = torch.get_num_threads()
    try:
        argv = ["--T", "5", "--batch", "2", "--rounds", "1", "--only", "tutorial 7", "Norse N"]
        code = _benchmark("bench_conv").main(argv)
    finally:
        torch.set_num_threads(threads)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.count("|") == 8]
    assert code == 0 and len(rows) == 2 + 2 * 4  # a header, its rule, four rows per model
    assert all(float(row.split("|")[-2]) < 1e-5 for row in rows[2:])


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name != "posix", reason="POSIX")
def test_bench_killed_by_sigterm_leaves_no_folder(tmp_path: Path) -> None:
    """``timeout 60 spikeckpt bench ...`` (or ``kill``) left an empty ``spikeckpt-bench-*``
    folder in the temporary folder at each run: the bench made it with ``TemporaryDirectory``,
    whose cleanup SIGTERM's default action skips (the disk stores inside remove their own)."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "spikeckpt", "bench", "--T", "400", "--repeats", "3",
            "--strategies", "double-disk,uniform", "--out", str(tmp_path / "out")]  # fmt: skip
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # the costs are measured: the bench's folders exist by now
            if line.startswith("measured costs"):
                break
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("spikeckpt")) == []
