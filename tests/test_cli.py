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
from spikeckpt.cli._args import Budget, split_value_problem

ROOT = Path(__file__).resolve().parents[1]
# this checkout first, then what the caller's PYTHONPATH holds (packages carried that way)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
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
    (["data", "synth", "--dataset", "shd", "--root", "x", "--seed", "-1"],
     "argument --seed: must be at least 0, got '-1'"),
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


# ---------------------------------------------------------- paths, checked while parsing

#: A child process: run the command line, then say whether anything slow was imported.
_NO_SLOW_IMPORTS = """
import json, sys
from spikeckpt.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
slow = [m for m in ("torch", "lightning", "tonic", "h5py") if m in sys.modules]
print(json.dumps({"status": status, "slow": slow}))
"""


def _early(argv: list[str], cwd: Path) -> tuple[int, list[str], str]:
    """``(status, slow modules imported, stderr)`` of the command line in a fresh process."""
    result = subprocess.run(
        [sys.executable, "-c", _NO_SLOW_IMPORTS, *argv],
        cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "XDG_CACHE_HOME": str(cwd / "cache")},
    )  # fmt: skip
    import json

    report = json.loads(result.stdout.splitlines()[-1])
    return report["status"], report["slow"], result.stderr


def test_bad_folders_are_refused_before_anything_slow(tmp_path: Path) -> None:
    """``--out`` and ``--root`` name the option and what is wrong with the path, at once."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (["demo", "--out", str(a_file)], f"argument --out: {a_file} is a file, not a folder"),
        (["demo", "--out", str(a_file / "plots")],
         f"argument --out: cannot create {a_file / 'plots'}: {a_file} is a file, not a folder"),
        (["bench", "--out", str(a_file)], f"argument --out: {a_file} is a file, not a folder"),
        (["demo", "--root", str(a_file)], f"argument --root: {a_file} is a file, not a folder"),
        (["data", "synth", "--dataset", "shd", "--root", str(a_file)],
         f"spikeckpt data synth: error: argument --root: {a_file} is a file, not a folder"),
    ]  # fmt: skip
    if Path("/proc/self").is_dir():  # a folder no one can create, even root
        cases.append((["demo", "--out", "/proc/spikeckpt/out"], "argument --out: cannot create"))
    for argv, message in cases:
        status, slow, err = _early(argv, tmp_path)
        assert status == 2, (argv, err)
        assert message in " ".join(err.split()), (argv, err)
        assert "Traceback" not in err and "Errno" not in err, err
        assert slow == [], (argv, slow)  # refused before torch, Lightning or tonic
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing created


def test_data_folder_errors_come_before_anything_slow(tmp_path: Path) -> None:
    """No SHD files, or the .h5 files without the .zip archives tonic checks for: the demo
    says which files and the fix before importing torch."""
    status, slow, err = _early(["demo", "--root", str(tmp_path / "none")], tmp_path)
    assert status == 2 and slow == []
    assert f"no SHD files under {tmp_path / 'none' / 'SHD'}" in " ".join(err.split())
    shd = tmp_path / "unzipped" / "SHD"
    shd.mkdir(parents=True)
    for name in ("shd_train.h5", "shd_test.h5"):
        (shd / name).write_bytes(b"")
    status, slow, err = _early(["demo", "--root", str(tmp_path / "unzipped")], tmp_path)
    flat = " ".join(err.split())
    assert status == 2 and slow == [], err
    assert "shd_train.h5.zip and shd_test.h5.zip" in flat
    assert f"`touch {shd / 'shd_train.h5.zip'} {shd / 'shd_test.h5.zip'}` fixes it" in flat


def test_every_command_takes_the_same_devices() -> None:
    parsers = _parsers()
    choices = {
        prog: action.choices
        for prog, parser in parsers.items()
        for action in parser._actions
        if "--device" in action.option_strings
    }
    assert set(choices) == {"spikeckpt demo", "spikeckpt bench"}
    assert all(tuple(c) == ("cpu", "cuda", "gpu") for c in choices.values()), choices


def test_plan_model_too_large_is_one_line(tmp_path: Path) -> None:
    argv = ["plan", "--T", "1000", "--budget", "5%", "--model", "1000000,1000000,10"]
    result = subprocess.run(
        [sys.executable, "-m", "spikeckpt", *argv], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "weights alone take 3.64 TiB" in lines[0]
    assert "give --state-bytes and --step-bytes instead" in lines[0]


def test_plan_names_a_double_without_remote_checkpoint_for_what_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["plan", "--T", "10000", "--budget", "500B", "--state-bytes", "1", "--step-bytes",
            "1", "--write-cost", "2", "--read-cost", "2"]  # fmt: skip
    status, out, _ = _exit(argv, capsys)
    assert status == 0
    table = out.split("\nDouble: ")[0]
    assert "Double(" not in table  # not listed as a Double ...
    assert (
        "Double: the fastest that fits, Double(remote_interval=10000, local_interval=464), "
        "keeps no remote checkpoint at T=10000: it is Uniform(interval=464)"
    ) in out  # ... but named for what it is
    assert "time/BPTT" in out and "x BPTT" not in out


def test_split_value_problem_leaves_good_values_alone() -> None:
    options = {"--budget"}
    assert split_value_problem(["--budget", "1GB", "--T", "5"], options) is None
    assert split_value_problem(["--budget", "25%"], options) is None
    assert split_value_problem(["--hidden", "-1"], options) is None  # not a byte option


def test_budget_resolves_shares_and_bytes() -> None:
    assert Budget(bytes=100).resolve(10**6) == 100
    assert Budget(share=0.25).resolve(1000) == 250
    assert str(Budget(share=0.05)) == "5%"


def test_plans_print_as_their_repr_whole_without_defaults() -> None:
    """One notation everywhere: the plan's own repr, every argument that is not its default."""
    from spikeckpt import plans

    assert repr(plans.Uniform(200)) == "Uniform(interval=200)"
    assert repr(plans.Uniform()) == "Uniform()"
    assert repr(plans.Double(64, 8)) == "Double(remote_interval=64, local_interval=8)"
    two = plans.TwoLevel(12, write_cost=2.0, read_cost=3.0)
    assert repr(two) == "TwoLevel(slots=12, write_cost=2.0, read_cost=3.0)"
    assert repr(plans.TwoLevel(12)) == "TwoLevel(slots=12)"
    for plan in (plans.Uniform(200), plans.Double(64, 8), two, plans.Revolve(3, tape=4)):
        assert eval(repr(plan), vars(plans)) == plan  # noqa: S307 - whole: it builds the plan


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
    assert not (tmp_path / "o").exists()  # the output folder: only made to write the plot


@needs_demo_extras
@pytest.mark.slow
def test_demo_default_share_below_the_smallest_budget_trains_within_that(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At T = 10 (``--dt-us 100000``) the default 25% of BPTT's activations is below what any
    plan fits (the callback keeps a 5% margin): the demo was refused by its own default. It
    now says so and trains within the smallest budget the refusal names; the step keeps it."""
    argv = ["demo", "--root", str(tmp_path), "--synthetic", "--samples", "4", "--epochs", "1",
            "--dt-us", "100000", "--no-progress", "--out", str(tmp_path / "o")]  # fmt: skip
    status, out, _ = _exit(argv, capsys)
    said = " ".join(out.split())
    assert status == 0, said[-2000:]
    assert "25% of BPTT's activations" in said and "training within that instead" in said
    assert "epoch 1/1" in said and (tmp_path / "o" / "demo.png").exists()
    budget = said.split("Budget ")[1].split(":")[0]  # the budget the table was kept within
    assert budget in said.split("smallest budget a training step of T=10 fits (")[1]


@needs_demo_extras
@pytest.mark.slow
def test_demo_training_accuracy_is_computed_like_validation_accuracy(tmp_path: Path) -> None:
    """With a learning rate of 0 the weights stay put: the training accuracy shown at the end
    of an epoch (the epoch's running mean) equals the accuracy computed on the same recordings
    the way validation computes it."""
    import lightning.pytorch as pl

    from spikeckpt.cli.demo import build_network, classifier_class, quiet_lightning
    from spikeckpt.data import SHDDataModule, write_synthetic_shd

    write_synthetic_shd(tmp_path, samples=24)
    data = SHDDataModule(tmp_path, dt_us=50_000, duration_us=1_000_000, batch_size=5,
                         download=False, packed=True)  # fmt: skip
    with quiet_lightning():
        model = classifier_class()(build_network("snntorch", 700, 8, 20), lr=0.0)
        trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0,
                             default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(model, datamodule=data)
        shown = float(trainer.progress_bar_metrics["train_acc"])
        measured = trainer.validate(model, dataloaders=data.train_dataloader(), verbose=False)
    assert shown == pytest.approx(measured[0]["val_acc"], abs=1e-6)


@needs_demo_extras
@pytest.mark.slow
def test_demo_on_a_file_that_is_not_hdf5_names_it(tmp_path: Path) -> None:
    from spikeckpt.data import write_synthetic_shd

    shd = write_synthetic_shd(tmp_path, samples=4)
    (shd / "SPIKECKPT_SYNTHETIC.json").unlink()  # as if these were the real files
    (shd / "shd_train.h5").write_bytes(b"\x00" * 512)
    result = subprocess.run(
        [sys.executable, "-m", "spikeckpt", "demo", "--root", str(tmp_path), "--out", "o"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert f"{shd / 'shd_train.h5'} is not an HDF5 file" in result.stderr
    assert "download shd_train.h5.zip again" in result.stderr
    assert not (tmp_path / "o").exists()


def test_demo_figure_has_the_budget_values_and_the_shape() -> None:
    from spikeckpt.cli.demo import StepMeasurement, demo_figure

    rows = [
        StepMeasurement("BPTT()", 184 * 2**20, 0.5, 0.0, 215 * 2**20),
        StepMeasurement("Uniform(interval=200)", 38 * 2**20, 0.65, 0.0, 46 * 2**20),
    ]
    figure = demo_figure(rows, T=1000, batch=32, budget_bytes=46 * 2**20)
    memory, seconds = figure.axes
    assert "T=1000, batch 32" in figure._suptitle.get_text()
    texts = [t.get_text() for axis in (memory, seconds) for t in axis.texts]
    for shown in ("184.00 MiB", "38.00 MiB", "0.50 s", "0.65 s", "budget 46.00 MiB"):
        assert shown in texts, (shown, texts)
    budget_lines = [line for line in memory.lines if line.get_linestyle() == "--"]
    assert len(budget_lines) == 1 and budget_lines[0].get_ydata()[0] == pytest.approx(46)
    assert "measured" in memory.get_ylabel() and "measured" in seconds.get_ylabel()


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
    assert chosen.plan == repr(summary["plan"])  # the table shows the plan it measured
    assert summary["choice"].batch == 8  # ... chosen for the measured batch's shape
    assert chosen.peak_bytes < bptt.peak_bytes
    assert chosen.max_grad_diff <= 1e-5
    assert summary["measured_peak_bytes"] <= summary["budget_bytes"]
    assert summary["plot"].exists() and summary["plot"].stat().st_size > 1000
    assert (tmp_path / "data" / "SHD" / "shd_train.h5").exists()
    text = " ".join(console.export_text().split())
    assert f"plan chosen by MemoryBudget for T=50, batch 8: {chosen.plan} (" in text
    # counts as --samples counts them: 16 training recordings, split for validation; 4 test
    data = summary["data"]
    counts = re.search(r"16 training recordings \((\d+) to train on, (\d+) held out", text)
    assert counts and int(counts[1]) + int(counts[2]) == 16, text
    assert "and 4 test recordings; batches of 8" in text
    # every figure once, labelled estimated or measured
    for figure in (bptt.estimated_bytes, chosen.estimated_bytes):
        assert figure is not None
    assert text.count("estimated") >= 2 and "measured" in text
    assert "peak/BPTT" in text and "time/BPTT" in text  # the ratios, named as in bench
    assert data.synthetic


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
        "PYTHONPATH": PYTHONPATH,
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
    plan = re.search(
        r"^plan chosen by MemoryBudget for T=20, batch 8: (\w+\([^)]*\))", out, re.MULTILINE
    )
    assert plan, out
    rows = [line.split() for line in out.splitlines() if line.startswith(plan.group(1))]
    assert rows, f"the table does not show {plan.group(1)} whole:\n{out}"
    assert all(len(line) <= 80 for line in out.splitlines()), out
    assert "test accuracy" in out and "plot: spikeckpt-out/demo.png" in out


def test_plan_and_bench_help_say_what_their_budget_covers() -> None:
    """`plan`/`bench` --budget covers checkpoints and tapes alone (docs/cli.md), unlike
    wrap(budget=) and MemoryBudget; the help said "device budget" only (h29)."""
    for prog in ("spikeckpt plan", "spikeckpt bench"):
        flat = " ".join(_parsers()[prog].format_help().split())
        assert "checkpoints and tapes alone" in flat, prog
        assert "whole training step" in flat, prog
