"""The command line a newcomer meets: help, ``--version``, early argument errors, the demo.

Argument errors are checked without training anything: each ends within a second or two.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spikeckpt.cli import build_parser, main
from spikeckpt.cli._args import Budget, plan_name, split_value_problem

ROOT = Path(__file__).resolve().parents[1]
HAVE_DEMO_EXTRAS = all(importlib.util.find_spec(m) for m in ("lightning", "snntorch", "tonic"))
needs_demo_extras = pytest.mark.skipif(not HAVE_DEMO_EXTRAS, reason="needs spikeckpt[all]")


def _exit(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the command line; return (status, stdout, stderr), argparse exits included."""
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return status, captured.out, captured.err


# ----------------------------------------------------------------------------- help, version


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import spikeckpt

    status, out, _ = _exit(["--version"], capsys)
    assert status == 0
    assert out.startswith(f"spikeckpt {spikeckpt.__version__} (Python ")
    assert "torch" in out


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser by its command (``spikeckpt``, ``spikeckpt demo``, ``... data synth``)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)

    walk(build_parser())
    return found


def test_every_command_is_there() -> None:
    assert set(_parsers()) == {
        "spikeckpt", "spikeckpt demo", "spikeckpt plan", "spikeckpt bench", "spikeckpt data",
        "spikeckpt data synth",
    }  # fmt: skip


@pytest.mark.parametrize("prog", sorted(_parsers()))
def test_help_is_for_users(prog: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = _parsers()[prog]
    undocumented = [
        action.option_strings or action.dest
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert not undocumented, f"{prog}: options without help: {undocumented}"
    text = parser.format_help()
    for developer_text in ("``", ":class:", ":func:", "args.handler", "(default: None)"):
        assert developer_text not in text, (prog, developer_text)
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, f"{prog}: help wider than 80 columns: {too_wide}"


def test_help_shows_defaults() -> None:
    demo = _parsers()["spikeckpt demo"].format_help()
    flat = " ".join(demo.split())
    for shown in ("(default: 128)", "(default: 32)", "(default: snntorch)", "(default: 25%)"):
        assert shown in flat, shown


def test_help_is_instant_and_imports_no_extra() -> None:
    code = (
        "import sys; from spikeckpt.cli import build_parser; build_parser().format_help();"
        "bad = [m for m in ('torch', 'lightning', 'tonic', 'rich') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ------------------------------------------------------------------------- argument errors

ARGUMENT_ERRORS = [
    (["demo", "--hidden", "0"], "argument --hidden: must be at least 1, got '0'"),
    (["demo", "--epochs", "0"], "argument --epochs: must be at least 1"),
    (["demo", "--samples", "0"], "argument --samples: must be at least 1"),
    (["demo", "--batch-size", "-3"], "argument --batch-size: must be at least 1"),
    (["demo", "--dt-us", "1.5"], "'1.5' is not a whole number"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["demo", "--budget", "plenty"], "cannot parse budget 'plenty'"),
    (["demo", "--budget", "1", "GB"], "write the number and its unit as one word, --budget 1GB"),
    (["demo", "--budget", "-1MiB"], "'-1MiB' is negative"),
    (["demo", "--budget=-1MiB"], "'-1MiB' is negative"),
    (["demo", "--budget", "5", "%"], "--budget 5%"),
    (["demo", "--budget", "0"], "a budget must be positive"),
    (["demo", "--budget", "150%"], "a percentage in (0, 100]"),
    (["plan", "--T", "0", "--budget", "1MiB", "--state-bytes", "1", "--step-bytes", "1"],
     "argument --T: must be at least 1"),
    (["plan", "--T", "9", "--budget", "1", "GB", "--state-bytes", "1", "--step-bytes", "1"],
     "--budget 1GB"),
    (["plan", "--T", "9", "--budget", "1MiB", "--state-bytes", "-4KiB", "--step-bytes", "1"],
     "'-4KiB' is negative"),
    (["plan", "--T", "9", "--budget", "1MiB", "--model", "700,x"], "cannot parse '700,x'"),
    (["bench", "--budget", "5", "%"], "--budget 5%"),
    (["bench", "--max-length", "5%"], "a byte count such as 8MiB here, not a percentage"),
    (["bench", "--T", "0"], "cannot parse '0' as sequence lengths"),
    (["bench", "--density", "2"], "must be a probability in [0, 1]"),
    (["bench", "--repeats", "0"], "argument --repeats: must be at least 1"),
    (["data", "synth", "--dataset", "mnist", "--root", "x"], "invalid choice: 'mnist'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"), ARGUMENT_ERRORS, ids=[" ".join(argv)[:50] for argv, _ in ARGUMENT_ERRORS]
)
def test_bad_arguments_stop_at_once_and_say_why(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _exit(argv, capsys)
    assert status == 2
    assert out == ""  # nothing printed before the error
    assert message in " ".join(err.split()), err
    assert "Traceback" not in err


def test_split_value_problem_leaves_good_values_alone() -> None:
    options = {"--budget"}
    assert split_value_problem(["--budget", "1GB", "--T", "5"], options) is None
    assert split_value_problem(["--budget", "25%"], options) is None
    assert split_value_problem(["--hidden", "-1"], options) is None  # not a byte option


def test_budget_resolves_shares_and_bytes() -> None:
    assert Budget(bytes=100).resolve(10**6) == 100
    assert Budget(share=0.25).resolve(1000) == 250
    assert str(Budget(share=0.05)) == "5%"


def test_plan_names_are_whole_and_drop_cost_copies() -> None:
    from spikeckpt import plans

    assert plan_name(plans.Uniform(200)) == "Uniform(interval=200)"
    assert plan_name(plans.Double(64, 8)) == "Double(remote_interval=64, local_interval=8)"
    assert plan_name(plans.TwoLevel(12, write_cost=2.0, read_cost=3.0)) == "TwoLevel(slots=12)"


def test_demo_gpu_on_a_cpu_machine_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    status, _, err = _exit(["demo", "--device", "gpu", "--out", str(tmp_path)], capsys)
    assert status == 2
    assert "no CUDA GPU is available here" in err and "use --device cpu" in err
    assert not list(tmp_path.iterdir())  # stopped before writing anything


@needs_demo_extras
def test_demo_root_without_data_is_an_error_not_synthetic_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "empty"
    status, _, err = _exit(["demo", "--root", str(root), "--out", str(tmp_path / "o")], capsys)
    assert status == 2
    flat = " ".join(err.split())
    assert f"no SHD files under {root / 'SHD'}" in flat
    assert "--synthetic" in flat and "leave out --root" in flat
    assert not root.exists() and not (tmp_path / "o").exists()  # nothing written


@needs_demo_extras
def test_demo_refuses_synthetic_options_on_real_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shd = tmp_path / "SHD"
    shd.mkdir()
    for name in ("shd_train.h5", "shd_test.h5", "shd_train.h5.zip", "shd_test.h5.zip"):
        (shd / name).touch()  # what tonic checks for; not read before the error
    base = ["demo", "--root", str(tmp_path), "--out", str(tmp_path / "o")]
    status, _, err = _exit([*base, "--samples", "64"], capsys)
    assert status == 2 and "holds the real SHD files" in " ".join(err.split())
    status, _, err = _exit([*base, "--synthetic"], capsys)
    assert status == 2 and "which --synthetic would not replace" in " ".join(err.split())


@needs_demo_extras
@pytest.mark.slow
def test_demo_budget_too_small_exits_3_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--root", str(tmp_path), "--synthetic", "--samples", "8", "--hidden", "8",
            "--dt-us", "50000", "--budget", "1KiB", "--out", str(tmp_path / "o")]  # fmt: skip
    status, out, _ = _exit(argv, capsys)
    assert status == 3
    assert "the smallest budget that fits is" in out
    assert "epoch 1/" not in out  # stopped before training


# ------------------------------------------------------------------------------- data synth


@pytest.mark.skipif(importlib.util.find_spec("tonic") is None, reason="needs tonic")
def test_data_synth_writes_and_says_how_to_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import tonic

    from spikeckpt.data.datasets import NMNIST

    for dataset, folder, use in (
        ("shd", "SHD", "SHDDataModule(root="),
        ("nmnist", "NMNIST", "NMNISTDataModule(root="),
    ):
        argv = ["data", "synth", "--dataset", dataset, "--root", str(tmp_path), "--samples", "8"]
        status, out, _ = _exit(argv, capsys)
        assert status == 0
        assert str(tmp_path / folder) in out and use in out
        if dataset == "nmnist":
            assert "SHD" not in out
    assert len(tonic.datasets.SHD(save_to=str(tmp_path), train=True)) == 8
    assert len(NMNIST(save_to=str(tmp_path), train=False)) == 2
    real = tmp_path / "real" / "SHD"
    real.mkdir(parents=True)
    (real / "shd_test.h5").write_bytes(b"")
    argv = ["data", "synth", "--dataset", "shd", "--root", str(tmp_path / "real")]
    status, _, err = _exit(argv, capsys)
    assert status == 2 and "refusing" in err


# -------------------------------------------------------------------------------- the demo


@needs_demo_extras
@pytest.mark.slow
def test_demo_run_measures_the_plan_it_reports(tmp_path: Path) -> None:
    from rich.console import Console

    from spikeckpt.cli.demo import run
    from spikeckpt.plans import BPTT

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    summary = run(
        tmp_path / "data", synthetic=True, out=tmp_path / "out", epochs=1, dt_us=20_000,
        hidden=16, batch_size=8, samples=16, progress=False, console=console,
    )  # fmt: skip
    console.file.close()
    assert summary["synthetic"]
    bptt, chosen = summary["rows"]
    assert not isinstance(summary["plan"], BPTT)
    assert chosen.plan == plan_name(summary["plan"])  # the table shows the plan it measured
    assert summary["choice"].batch == 8  # ... chosen for the measured batch's shape
    assert chosen.peak_bytes < bptt.peak_bytes
    assert chosen.max_grad_diff <= 1e-5
    assert summary["measured_peak_bytes"] <= summary["budget_bytes"]
    assert summary["plot"].exists() and summary["plot"].stat().st_size > 1000
    assert (tmp_path / "data" / "SHD" / "shd_train.h5").exists()
    text = console.export_text()
    assert f"plan for T=50, B=8: {chosen.plan}," in text


@needs_demo_extras
@pytest.mark.slow
def test_demo_in_a_clean_checkout(tmp_path: Path) -> None:
    """As a newcomer runs it: the repository's ignore rules, a terminal 80 columns wide.

    The demo runs in a fresh git repository holding this repository's ``.gitignore`` (what a
    clone has), with the cache folder outside it; afterwards ``git status`` must be empty.
    """
    git = shutil.which("git")
    if git is None:
        pytest.skip("needs git")
    tree = tmp_path / "clone"
    tree.mkdir()
    shutil.copy(ROOT / ".gitignore", tree / ".gitignore")
    quiet = {"capture_output": True, "check": True, "cwd": tree}
    subprocess.run([git, "init", "-q"], **quiet)
    subprocess.run([git, "add", ".gitignore"], **quiet)
    subprocess.run(
        [git, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "clone"], **quiet
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "COLUMNS": "80",
        "OMP_NUM_THREADS": "1",
    }
    argv = ["--epochs", "1", "--dt-us", "50000", "--hidden", "8", "--batch-size", "8"]
    result = subprocess.run(
        [sys.executable, "-m", "spikeckpt", "demo", *argv, "--samples", "24"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    status = subprocess.run([git, "status", "--porcelain"], text=True, **quiet).stdout
    assert status == "", f"the demo left files in the checkout:\n{status}"
    assert (tmp_path / "cache" / "spikeckpt" / "data" / "SHD" / "shd_train.h5").exists()
    # the data source is said loudly; Lightning's own notes and warnings are not shown
    assert "SYNTHETIC DATA (no --root given)" in out
    for noise in ("Tip", "GPU available", "max_epochs", "LeafSpec", "Epoch "):
        assert noise not in out + result.stderr, noise
    assert "epoch 1/1" in out
    # our summaries on lines of their own; the plan in the table is the plan reported
    plan = re.search(r"^plan for T=20, B=8: (\w+\([^)]*\)),", out, re.MULTILINE)
    assert plan, out
    rows = [line.split() for line in out.splitlines() if line.startswith(plan.group(1))]
    assert rows, f"the table does not show {plan.group(1)} whole:\n{out}"
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "test accuracy" in out and "plot: spikeckpt-out/demo.png" in out
