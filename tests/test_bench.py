"""``spikeckpt bench``: the quick sweep, its outputs, exact gradients, clear errors, the search."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from spikeckpt.bench.measure import calibrate, scratch_directory
from spikeckpt.bench.search import max_length
from spikeckpt.bench.strategies import STRATEGIES, Workload, available, parse_strategies
from spikeckpt.cli import main


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("bench")
    torch_threads = torch.get_num_threads()
    try:
        code = main(["bench", "--quick", "--T", "16,48", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(torch_threads)
    assert code == 0
    return out, (out / "bench.md").read_text()


def test_quick_writes_json_csv_and_png(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["threads"] == 1
    assert {row["T"] for row in data["rows"]} == {16, 48}
    csv_lines = (out / "bench.csv").read_text().splitlines()
    assert csv_lines[0].startswith("strategy,label,T,")
    assert len(csv_lines) == 1 + len(data["rows"])
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_every_available_strategy(quick_run: tuple[Path, str]) -> None:
    _, table = quick_run
    for name in available():
        if name == "twolevel-async":
            continue  # Kukreja's scheme runs only when asked for
        assert STRATEGIES[name].label in table, name
    assert "layer-wise host" in table and "layer-wise disk" in table


def test_gradients_match_bptt_to_round_off(quick_run: tuple[Path, str]) -> None:
    out, _ = quick_run
    rows = json.loads((out / "bench.json").read_text())["rows"]
    ran = [r for r in rows if r["fits"] and r["strategy"] != "bptt"]
    assert len(ran) >= 8
    for row in ran:
        assert row["max_rel_grad_diff"] <= 1e-5, row
        assert row["peak_bytes"] > 0 and row["time_s"] > 0 and row["evals_per_step"] >= 1


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
    assert "Double" in double.best_row.plan
    assert math.isfinite(double.best / bptt.best)
