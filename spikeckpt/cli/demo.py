"""``spikeckpt demo``: train a spiking network on SHD with a device memory budget.

Steps: find the data (the real SHD files under ``--root``, or synthetic files in the real
format, said loudly); wrap a snnTorch (or Norse) LIF network; train it with Lightning and
[`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget]; then measure one training step with plain BPTT and
with the plan chosen for that batch's shape (peak memory by [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter],
time, largest gradient difference), print a table and save a plot.

Every argument, ``--out`` and ``--root`` included, is checked before anything slow starts;
so is the data folder. Lightning, snnTorch and tonic are imported only when the demo runs
(``spikeckpt[all]``). Synthetic data go to the user's cache folder (``$XDG_CACHE_HOME/spikeckpt``,
else ``~/.cache/spikeckpt``), never into the working folder; only the plot is written there
(``--out``, created when the plot is saved).

On the screen every quantity appears once, labelled "estimated" (the planner's account) or
"measured" ([`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter], wall-clock time).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spikeckpt.cli._args import (
    DEVICE_HELP,
    DEVICES,
    Budget,
    budget,
    check_device,
    data_folder,
    folder_problem,
    output_folder,
    positive_int,
)
from spikeckpt.errors import BudgetTooSmall, ConfigError

if TYPE_CHECKING:
    import torch
    from rich.console import Console
    from torch import nn

    from spikeckpt.plans import Plan

#: The default budget: plain BPTT's activations times this share, plus model, gradients, Adam.
DEFAULT_BUDGET = Budget(share=0.25)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``spikeckpt demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="train an SNN on SHD within a device memory budget and compare with plain BPTT",
        description=(
            "Train a 700-H-H-20 LIF network on SHD with Lightning and the MemoryBudget\n"
            "callback, which picks a checkpointing plan that fits the device budget; then\n"
            "measure one training step under plain BPTT and under that plan (peak memory,\n"
            "time, gradient difference), print a table and save a plot.\n\n"
            "Data: the real SHD files under --root DIR (DIR/SHD/shd_train.h5, shd_test.h5;\n"
            "see docs/datasets.md). Without --root, synthetic files in the real format, kept\n"
            "in your cache folder. The defaults take 35 s to 2 minutes on 2 CPU cores."
        ),
        epilog=(
            "examples:\n"
            "  spikeckpt demo                          synthetic SHD, the default budget\n"
            "  spikeckpt demo --root ~/data            the real SHD files in ~/data/SHD\n"
            "  spikeckpt demo --budget 8MiB --hidden 256 --epochs 1"
        ),
    )
    data = parser.add_argument_group("data")
    data.add_argument(
        "--root",
        type=data_folder,
        default=None,
        metavar="DIR",
        help="folder holding the real SHD files in DIR/SHD (tonic's save_to); without it the "
        "demo trains on synthetic data",
    )
    data.add_argument(
        "--synthetic",
        action="store_true",
        help="train on synthetic files even with --root (written to DIR/SHD if absent)",
    )
    data.add_argument(
        "--samples",
        type=positive_int,
        default=None,
        metavar="N",
        help="training recordings of the synthetic data, plus N/4 for testing (default: 256)",
    )
    data.add_argument(
        "--dt-us",
        type=positive_int,
        default=1000,
        metavar="US",
        help="time step in microseconds; recordings are cut to 1 s: T = 1e6/US steps",
    )
    train = parser.add_argument_group("network and training")
    train.add_argument(
        "--framework",
        choices=("snntorch", "norse"),
        default="snntorch",
        help="the spiking library the network is built with",
    )
    train.add_argument("--hidden", type=positive_int, default=128, help="neurons per hidden layer")
    train.add_argument(
        "--batch-size", type=positive_int, default=32, metavar="B", help="recordings per batch"
    )
    train.add_argument("--epochs", type=positive_int, default=2, help="training epochs")
    train.add_argument(
        "--budget",
        type=budget,
        default=DEFAULT_BUDGET,
        help="device memory for a training step: bytes (64MiB), or a share of what plain "
        "BPTT's activations need (25%%), added to the model, gradients and optimizer state",
    )
    train.add_argument("--device", choices=DEVICES, default="cpu", help=DEVICE_HELP)
    output = parser.add_argument_group("output")
    output.add_argument(
        "--out",
        type=output_folder,
        default="spikeckpt-out",
        metavar="DIR",
        help="folder for the plot demo.png (created when the plot is saved)",
    )
    output.add_argument("--no-progress", action="store_true", help="one line per epoch, no bar")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; exit 3 when the budget is too small."""
    from spikeckpt.errors import BudgetTooSmall

    try:
        run(
            args.root,
            synthetic=True if args.synthetic else None,
            epochs=args.epochs,
            budget=args.budget,
            dt_us=args.dt_us,
            framework=args.framework,
            device=args.device,
            hidden=args.hidden,
            batch_size=args.batch_size,
            samples=args.samples,
            out=args.out,
            progress=not args.no_progress,
        )
    except BudgetTooSmall as error:
        print(f"spikeckpt demo: {error}")
        return 3
    return 0


# ------------------------------------------------------------------------------------ data


def cache_folder() -> Path:
    """Where the demo keeps synthetic data: ``$XDG_CACHE_HOME/spikeckpt`` or ``~/.cache/...``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "spikeckpt"


@dataclass(frozen=True)
class DataSource:
    """Where the demo's SHD files are and what they are."""

    root: Path  # tonic's save_to; the files are in root/SHD
    synthetic: bool
    why: str  # one sentence for the user


def find_data(root: str | Path | None, synthetic: bool | None, samples: int | None) -> DataSource:
    """Decide which SHD files the demo trains on; write synthetic ones when that is asked for.

    ``root=None``: synthetic files in `cache_folder`. An explicit ``root`` must hold SHD
    files (real, or synthetic ones from ``spikeckpt data synth``) unless ``synthetic=True``.
    Imports neither torch nor tonic.

    Raises:
        DataNotFoundError: ``root`` holds no SHD files and synthetic data were not asked for.
        ValueError: contradictory arguments (``samples`` with real files, ``synthetic`` where
            real files are), or a folder that cannot be written where synthetic files must go.
    """
    from spikeckpt.data.errors import DataNotFoundError
    from spikeckpt.data.files import files_present, shd_placeholder_hint
    from spikeckpt.data.synthetic import synthetic_marker

    if root is None:
        folder = cache_folder() / "data"
        _ensure_synthetic(folder, samples or 256, "the cache folder")
        return DataSource(folder, True, "no --root given")
    folder = Path(root).expanduser()
    present = all(files_present("shd", folder, train) for train in (True, False))
    marker = synthetic_marker(folder / "SHD") if present else None
    if present and marker is None:  # real files
        if synthetic:
            raise ConfigError(
                f"{folder / 'SHD'} holds real SHD files, which --synthetic would not replace: "
                "drop --synthetic to train on them, or give another --root"
            )
        if samples is not None:
            raise ConfigError(
                f"--samples sets the size of synthetic data, but {folder / 'SHD'} holds the real "
                "SHD files, which are used whole: drop --samples"
            )
        return DataSource(folder, False, f"--root {folder}")
    if synthetic:
        _ensure_synthetic(folder, samples or 256, "--root")
        return DataSource(folder, True, "--synthetic")
    if present:
        if samples is not None and marker and marker.get("train_samples") != samples:
            raise ConfigError(
                f"{folder / 'SHD'} holds {marker.get('train_samples')} synthetic training "
                f"recordings, not {samples}: add --synthetic to rewrite them, or drop --samples"
            )
        return DataSource(folder, True, f"--root {folder} holds synthetic files")
    hint = shd_placeholder_hint(folder)
    if hint:
        raise DataNotFoundError(f"SHD files incomplete (--root {root}): {hint}")
    raise DataNotFoundError(
        f"no SHD files under {folder / 'SHD'} (--root {root}): the demo needs shd_train.h5 and "
        "shd_test.h5 there, with the archives shd_train.h5.zip and shd_test.h5.zip beside them "
        "(see docs/datasets.md). Fix: put the real files there; or add --synthetic to write "
        "synthetic files in the real format there; or leave out --root to train on synthetic "
        f"data kept in {cache_folder()}"
    )


def _ensure_synthetic(folder: Path, samples: int, option: str) -> None:
    """Synthetic SHD under ``folder/SHD`` with ``samples`` training recordings (seed 0).

    Rewritten unless a complete set with these settings is there (an interrupted write leaves
    an incomplete marker: the next run writes again). ``option`` names where ``folder`` came
    from, for the error when it cannot be written.
    """
    from spikeckpt.data.files import files_present
    from spikeckpt.data.synthetic import synthetic_marker, write_synthetic_shd

    marker = synthetic_marker(folder / "SHD") or {}
    same = (
        marker.get("train_samples") == samples
        and marker.get("seed") == 0
        and marker.get("complete", True) is not False
    )
    if same and all(files_present("shd", folder, train) for train in (True, False)):
        return
    problem = folder_problem(folder / "SHD")
    if problem:
        raise ConfigError(f"cannot write synthetic SHD files ({option}): {problem}")
    write_synthetic_shd(folder, samples=samples, seed=0)


# ------------------------------------------------------------------------------- the model


def build_network(framework: str, inputs: int, hidden: int, classes: int) -> nn.Module:
    """``inputs -> hidden -> hidden -> classes`` LIF network from snnTorch or Norse."""
    from torch import nn

    if framework == "snntorch":
        import snntorch as snn

        return nn.Sequential(
            nn.Linear(inputs, hidden),
            snn.Leaky(beta=0.95, learn_beta=True),
            nn.Linear(hidden, hidden),
            snn.Leaky(beta=0.95, learn_beta=True),
            nn.Linear(hidden, classes),
            snn.Leaky(beta=0.95),
        )
    if framework == "norse":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # norse: torch.jit.script
            import norse.torch as norse

        return nn.Sequential(
            nn.Linear(inputs, hidden),
            norse.LIFCell(),
            nn.Linear(hidden, hidden),
            norse.LIFCell(),
            nn.Linear(hidden, classes),
            norse.LIFCell(),
        )
    raise ConfigError(f"unknown framework {framework!r}: use 'snntorch' or 'norse'")


@functools.cache
def classifier_class() -> type:
    """The LightningModule class of the demo (defined on first use: Lightning loads slowly)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    import spikeckpt
    from spikeckpt.plans import BPTT

    class SpikeCountClassifier(pl.LightningModule):
        """Classifies spike trains ``(T, B, C)`` by the output spike counts (``readout="sum"``).

        Loss and accuracy are means over the recordings of an epoch in training, validation
        and test alike: in training the running mean of the epoch so far (the value at the
        end of an epoch is that epoch's mean, as for validation).
        """

        def __init__(self, network: nn.Module, lr: float = 2e-3, storage: str = "host") -> None:
            super().__init__()
            # eager: the demo's stated time has no compiling in it (compile="auto" would
            # compile a shape's step after 5 s of its forward calls: spikeckpt.engine.auto_compile)
            self.net = spikeckpt.wrap(
                network, plan=BPTT(), storage=storage, readout="sum", compile=False
            )
            self.lr = lr
            self._seen = 0
            self._correct = 0
            self._loss_sum = 0.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)  # (B, classes) spike counts

        def _step(self, batch: tuple[torch.Tensor, torch.Tensor], name: str) -> torch.Tensor:
            x, y = batch
            counts = self(x)
            loss = nn.functional.cross_entropy(counts, y)
            correct = counts.argmax(1) == y
            size = len(y)
            if name == "train":  # running means over the epoch, shown as it goes
                self._seen += size
                self._correct += int(correct.sum())
                self._loss_sum += float(loss.detach()) * size
                self.log("train_loss", self._loss_sum / self._seen, prog_bar=True)
                self.log("train_acc", self._correct / self._seen, prog_bar=True)
                return loss
            accuracy = correct.float().mean()
            self.log(f"{name}_loss", loss, prog_bar=True, batch_size=size, on_epoch=True)
            self.log(f"{name}_acc", accuracy, prog_bar=True, batch_size=size, on_epoch=True)
            return loss

        def on_train_epoch_start(self) -> None:
            self._seen = self._correct = 0
            self._loss_sum = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self._step(batch, "train")

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._step(batch, "val")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self._step(batch, "test")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.lr)

    return SpikeCountClassifier


# --------------------------------------------------------------------------------- training


def _progress_callback(console: Console, live: bool) -> Any:
    """A Lightning callback that shows one line per epoch: a live bar (on a terminal), or a
    line at the epoch's end.

    Our own, so the demo's summaries can follow on their own lines once training is over.
    Its `stop` ends a live bar (and shows the cursor again) wherever training ended,
    Ctrl-C included.
    """
    import lightning.pytorch as pl
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    def metrics(trainer: pl.Trainer) -> str:
        shown = {"train_loss": "loss", "train_acc": "acc", "val_acc": "val acc"}
        values = trainer.progress_bar_metrics
        return "  ".join(
            f"{name} {float(values[k]):.2f}" for k, name in shown.items() if k in values
        )

    class EpochProgress(pl.Callback):
        def __init__(self) -> None:
            self.progress: Progress | None = None
            self.task: Any = None
            self.started = 0.0

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.started = time.perf_counter()
            description = f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}"
            if not live:
                return
            if self.progress is None:
                self.progress = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(bar_width=12),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    TextColumn("{task.fields[metrics]}"),
                    console=console,
                )
                self.progress.start()
            total = trainer.num_training_batches
            self.task = self.progress.add_task(
                description, total=None if total == float("inf") else total, metrics=""
            )

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self.progress is not None:
                self.progress.update(self.task, advance=1, metrics=metrics(trainer))

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.progress is not None:
                self.progress.update(self.task, metrics=metrics(trainer))
            else:
                seconds = time.perf_counter() - self.started
                console.print(
                    f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} ({seconds:.0f} s): "
                    + metrics(trainer)
                )

        def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            self.stop()

        def stop(self, clear: bool = False) -> None:
            """End the live bar, if any (idempotent); ``clear``: erase it (training failed)."""
            if self.progress is not None:
                self.progress.live.transient = clear
                self.progress.stop()
                self.progress = None

    return EpochProgress()


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence what is not ours: Lightning's start-up notes and tips, a pytree deprecation and
    its "GPU available but not used" (the demo names the GPU itself).

    Lightning's warnings about real problems still show (only the info level is hidden).
    """
    import lightning.pytorch  # noqa: F401 - its import sets its loggers' levels: set ours after

    names = ("lightning", "lightning.pytorch", "lightning.fabric")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
            # --device cpu is a choice here: the demo says itself when a GPU is present
            warnings.filterwarnings("ignore", message=r"GPU available but not used")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


# -------------------------------------------------------------------------------- measuring


@dataclass
class StepMeasurement:
    """One training step (forward and backward) measured with one plan.

    Attributes:
        plan: the plan's ``repr``.
        peak_bytes: measured device peak of the whole step: the model, its gradients, the
            optimizer state, the batch and everything the step allocates.
        seconds: measured time of the step (the faster of two).
        max_grad_diff: largest ``|g - g_bptt|`` over every parameter element.
        estimated_bytes: the same peak as the planner estimates it (None: not estimated).
    """

    plan: str
    peak_bytes: int
    seconds: float
    max_grad_diff: float
    estimated_bytes: int | None = None


def measure_step(
    model: Any,
    batch: Any,
    plan: Plan,
    reference: list[torch.Tensor] | None,
    optimizers: Any = (),
    estimated_bytes: int | None = None,
) -> tuple[StepMeasurement, list[torch.Tensor]]:
    """Peak memory, time and gradients of one forward+backward with ``plan``.

    Time is the faster of two unmeasured steps; the peak comes from a third step run inside
    [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter] (which slows tiny ops down on CPU, so it is not timed),
    which also counts what the step holds from before it starts (the parameters, the
    ``optimizers``' state, the batch), as [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] does.
    """
    from torch import nn

    from spikeckpt.engine.meter import MemoryMeter
    from spikeckpt.lightning.resources import step_resident

    x, y = batch
    model.net.plan = plan

    def step() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()

    times = []
    for _ in range(2):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    with MemoryMeter(x.device) as meter:
        meter.track(step_resident(model, optimizers, batch))
        nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    diff = 0.0
    if reference is not None:
        diff = max(float((a - b).abs().max()) for a, b in zip(grads, reference, strict=True))
    model.zero_grad(set_to_none=True)
    row = StepMeasurement(repr(plan), meter.peak_bytes, min(times), diff, estimated_bytes)
    return row, grads


def budget_parts(model: Any, x: Any) -> tuple[int, int]:
    """``(fixed, bptt)`` in bytes, estimated: what a training step holds besides the
    activations (the model, ``.grad``, Adam's two moments, the engine's gradient buffers, the
    input train as it reaches the device, one step's working memory, stacked outputs); plain
    BPTT's activations.

    ``x``: the batch's input, ``(T, B, ...)``, a dense tensor or a packed spike train."""
    from spikeckpt.engine.inputs import input_nbytes, step_of
    from spikeckpt.planning import probe_model

    net = model.net
    x_0 = step_of(x, 0, x.device)
    probe = probe_model(net, x, net.initial_state(x_0), net.storage)
    T = int(x.shape[0])
    bptt = probe.state_bytes + T * probe.step_bytes
    from spikeckpt.storage.base import tensor_nbytes  # torch only when asked

    params = sum(tensor_nbytes(p) for p in model.parameters())
    outputs = 2 * T * probe.output_bytes if net.readout is None else 0
    fixed = 6 * params + input_nbytes(x) + probe.work_bytes + outputs
    return fixed, bptt


#: fits tried with a share of BPTT's activations as the budget: the share's bytes, then the
#: smallest budget each refusal names (a refusal before the first optimizer step)
_SHARE_ATTEMPTS = 3


def _share_raised(chosen: Budget, budget_bytes: int, minimum_bytes: int, *, T: int) -> str:
    """The line that says a share's budget was below the smallest that fits, and what runs."""
    from spikeckpt.units import format_bytes

    return (
        f"{chosen} of BPTT's activations ({format_bytes(budget_bytes)} in all) is below the "
        f"smallest budget a training step of T={T} fits ({format_bytes(minimum_bytes)}): "
        "training within that instead (a --budget in bytes is refused rather than raised)"
    )


def _as_budget(value: Budget | int | str | None) -> Budget:
    if value is None:
        return DEFAULT_BUDGET
    if isinstance(value, Budget):
        return value
    if isinstance(value, int):
        return Budget(bytes=value)
    try:
        return budget(value)
    except argparse.ArgumentTypeError as error:
        raise ConfigError(str(error)) from None


# ---------------------------------------------------------------------------------- the job


def run(
    root: str | Path | None = None,
    *,
    synthetic: bool | None = None,
    epochs: int = 2,
    budget: Budget | int | str | None = None,
    dt_us: int = 1000,
    framework: str = "snntorch",
    device: str = "cpu",
    hidden: int = 128,
    batch_size: int = 32,
    samples: int | None = None,
    out: str | Path = "spikeckpt-out",
    progress: bool = True,
    console: Console | None = None,
) -> dict[str, Any]:
    """Train, compare BPTT with the chosen plan, print a table, save a plot.

    Args:
        root: tonic's ``save_to`` holding ``SHD/``; None: synthetic data in the cache folder.
        synthetic: write and use synthetic files under ``root`` (None: only when ``root`` is
            None).
        budget: bytes, ``"64MiB"``, or a share of BPTT's activations such as ``"25%"``
            (the default), on top of the model, gradients and Adam's state.
        samples: training recordings of synthetic data (default 256).
        out: folder for ``demo.png``, created when the plot is saved.

    Returns:
        A summary (plan, choice, measurements, accuracy, plot path, data source) for tests and
        scripts.
    """
    for name, value in (("epochs", epochs), ("dt_us", dt_us), ("hidden", hidden)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if batch_size < 1 or (samples is not None and samples < 1):
        raise ConfigError(f"batch_size and samples must be at least 1, got {batch_size}, {samples}")
    chosen_budget = _as_budget(budget)
    if framework not in ("snntorch", "norse"):
        raise ConfigError(f"unknown framework {framework!r}: use 'snntorch' or 'norse'")
    device = check_device(device)
    out = Path(out).expanduser()
    problem = folder_problem(out)
    if problem:
        raise ConfigError(f"--out {out}: {problem}: give a folder you can write to")
    if console is None:
        from rich.console import Console

        console = Console(highlight=False)
    console.print(
        f"spikeckpt demo: train a 700-{hidden}-{hidden}-20 LIF network ({framework}) on SHD "
        "within a device memory budget, then compare one training step of plain BPTT with "
        "the plan spikeckpt chose."
    )
    source = find_data(root, synthetic, samples)
    with quiet_lightning():
        return _run(
            source, console, epochs, chosen_budget, dt_us, framework, device, hidden,
            batch_size, out, progress,
        )  # fmt: skip


def _counts(data: Any, batch_size: int) -> str:
    """The data line: T, the recordings as ``--samples`` counts them, the batch size used."""
    train, val, test = len(data.train_set), len(data.val_set), len(data.test_set)
    plural = "" if test == 1 else "s"
    recordings = (
        f"{train + val} training recordings ({train} to train on, {val} held out for "
        f"validation) and {test} test recording{plural}"
    )
    batches = f"batches of {batch_size}"
    if batch_size > train:
        batches = (
            f"batches of {train} (--batch-size {batch_size} is more than the {train} to train on)"
        )
    return f"T = {data.T} steps of {data.dt_us} us; {recordings}; {batches}"


def _run(
    source: DataSource,
    console: Console,
    epochs: int,
    chosen_budget: Budget,
    dt_us: int,
    framework: str,
    device: str,
    hidden: int,
    batch_size: int,
    out: Path,
    progress: bool,
) -> dict[str, Any]:
    from spikeckpt.data.synthetic import synthetic_marker

    location = source.root / "SHD"
    if source.synthetic:
        marker = synthetic_marker(location) or {}
        console.print(
            f"[bold yellow]SYNTHETIC DATA[/] ({source.why}): {marker.get('train_samples', '?')} "
            f"training recordings in the real SHD format, in {location}. They only exercise the "
            "code: accuracy on them says nothing about SHD. For the real data: --root DIR with "
            "DIR/SHD/shd_train.h5 and shd_test.h5 (docs/datasets.md)."
        )
    else:
        console.print(f"data: the real SHD files in {location}")

    import lightning.pytorch as pl
    import torch

    from spikeckpt.bench.measure import choose_threads
    from spikeckpt.data import SHDDataModule
    from spikeckpt.lightning import MemoryBudget
    from spikeckpt.plans import BPTT
    from spikeckpt.units import format_bytes

    torch.manual_seed(0)
    if device == "cpu":
        threads, reason = choose_threads()
        console.print(f"torch threads: {threads} ({reason})")
        if torch.cuda.is_available():
            console.print("a CUDA GPU is present: --device cuda trains on it")
    data = SHDDataModule(
        source.root,
        dt_us=dt_us,
        duration_us=1_000_000,
        batch_size=batch_size,
        seed=0,
        download=False,
        packed=True,  # the input train reaches the device packed (1 bit per element or less)
    )
    data.prepare_data()
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None and data.test_set is not None
    console.print(_counts(data, batch_size))

    network = build_network(framework, 700, hidden, data.num_classes)
    model = classifier_class()(network)
    batch = next(iter(data.train_dataloader()))
    fixed, bptt = budget_parts(model, batch[0])
    T0 = int(batch[0].shape[0])
    if chosen_budget.bytes is not None:
        budget_bytes = chosen_budget.bytes
        how = f"--budget; plain BPTT would need {format_bytes(fixed + bptt)}, estimated"
    else:
        budget_bytes = fixed + chosen_budget.resolve(bptt)
        how = (
            f"{chosen_budget} of the {format_bytes(bptt)} of activations plain BPTT would keep, "
            f"plus {format_bytes(fixed)} for the model, gradients, Adam, the packed input and "
            "the engine's buffers; both estimated"
        )
    console.print(f"device budget for a training step: {format_bytes(budget_bytes)} ({how})")

    def trainer_within(budget_bytes: int) -> tuple[pl.Trainer, MemoryBudget, Any]:
        callback = MemoryBudget(budget_bytes, storage="host", verbose=False)
        bar = _progress_callback(console, live=progress and console.is_terminal)
        trainer = pl.Trainer(
            accelerator=device,
            devices=1,
            max_epochs=epochs,
            callbacks=[callback, bar],
            logger=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        )
        return trainer, callback, bar

    started = time.perf_counter()
    for attempt in range(_SHARE_ATTEMPTS):
        trainer, callback, bar = trainer_within(budget_bytes)
        try:
            trainer.fit(model, datamodule=data)
            break
        except BudgetTooSmall as error:
            bar.stop(clear=True)
            if chosen_budget.share is None or trainer.global_step or attempt + 1 == _SHARE_ATTEMPTS:
                raise
            console.print(_share_raised(chosen_budget, budget_bytes, error.minimum_bytes, T=T0))
            budget_bytes = error.minimum_bytes
        except BaseException:
            bar.stop(clear=True)  # a refusal, an error, Ctrl-C: no stale bar, the cursor back
            raise
    bar.stop()
    console.print(f"trained {epochs} epoch(s) in {time.perf_counter() - started:.0f} s")

    planner = callback.planners["net"]
    T, B = int(batch[0].shape[0]), int(batch[0].shape[1])
    choice = planner.choices[(T, B)]
    console.print(
        f"plan chosen by MemoryBudget for T={T}, batch {B}: {choice.plan!r} (estimated "
        f"{choice.recompute_factor:.2f} step evaluations per step, {choice.time_factor:.2f}x "
        "BPTT's time)"
    )
    # keyed by the calls' own shapes (a plan made for a longer or denser input serves them)
    others = [(key, c) for key, c in planner.choices.items() if key != (T, B)]
    if others:
        console.print(
            "  and for the other training batch shapes it met (a smaller last batch; "
            "validation and test run without gradients, unplanned): "
            + "; ".join(f"T={key[0]}, batch {key[1]}: {c.plan!r}" for key, c in others)
        )

    test = trainer.test(model, datamodule=data, verbose=False)
    accuracy = float(test[0]["test_acc"]) if test else float("nan")

    model.net.set_planner(None)
    batch = tuple(t.to(model.device) for t in batch)
    optimizers = trainer.optimizers
    bptt_row, reference = measure_step(model, batch, BPTT(), None, optimizers, fixed + bptt)
    chosen_row, _ = measure_step(
        model, batch, choice.plan, reference, optimizers, callback.modeled_step_bytes
    )
    rows = [bptt_row, chosen_row]
    print_table(rows, console, T=T, batch=B, budget_bytes=callback.total_bytes)
    chance = 1 / data.num_classes
    console.print(
        f"test accuracy: {accuracy:.3f} (chance {chance:.3f})"
        + (", on synthetic data" if source.synthetic else "")
    )
    out.mkdir(parents=True, exist_ok=True)
    plot = save_plot(rows, out / "demo.png", T=T, batch=B, budget_bytes=callback.total_bytes)
    console.print(f"plot: {plot}")
    return {
        "plan": choice.plan,
        "choice": choice,
        "rows": rows,
        "accuracy": accuracy,
        "plot": plot,
        "budget_bytes": budget_bytes,
        "measured_peak_bytes": callback.measured_peak_bytes,
        "synthetic": source.synthetic,
        "data": source,
    }


#: Columns of the demo's table (``peak/BPTT`` and ``time/BPTT`` as in ``spikeckpt bench``);
#: two-line headers keep it within 80 columns.
TABLE_HEADER = [
    "plan",
    "peak\nestimated",
    "peak\nmeasured",
    "peak/BPTT",
    "time",
    "time/BPTT",
]


def table_cells(rows: list[StepMeasurement]) -> list[list[str]]:
    """The cells of the demo's table, one row per plan (BPTT first: the ratios' base)."""
    from spikeckpt.units import format_bytes

    base = rows[0]
    return [
        [
            row.plan,
            format_bytes(row.estimated_bytes) if row.estimated_bytes is not None else "-",
            format_bytes(row.peak_bytes),
            f"{row.peak_bytes / base.peak_bytes:.3f}",
            f"{row.seconds:.2f} s",
            f"{row.seconds / base.seconds:.2f}",
        ]
        for row in rows
    ]


def print_table(
    rows: list[StepMeasurement],
    console: Console,
    *,
    T: int,
    batch: int,
    budget_bytes: int | None = None,
) -> None:
    """The BPTT-vs-plan table (whole plan names; split when the terminal is too narrow), what
    its peak counts, the budget, and the largest gradient difference."""
    from spikeckpt.bench.report import fitting_tables, print_tables
    from spikeckpt.units import format_bytes

    title = f"one training step, T={T}, batch {batch}: plain BPTT vs the chosen plan"
    console.print()
    tables = fitting_tables(title, TABLE_HEADER, table_cells(rows), keys=1, width=console.width)
    print_tables(console, tables)
    chosen = rows[-1]
    console.print(
        "peak: the device memory of the whole step (model, gradients, Adam's state, batch, "
        "activations), estimated by the planner and measured by MemoryMeter; time: measured"
        + (
            f". Budget {format_bytes(budget_bytes)}: the chosen plan's measured peak is "
            f"{chosen.peak_bytes / budget_bytes:.2f} of it"
            if budget_bytes
            else ""
        )
    )
    diff = f"{chosen.max_grad_diff:.1e}" if chosen.max_grad_diff else "0 (bitwise equal)"
    console.print(f"gradients: largest difference to plain BPTT's, measured: {diff}")


def save_plot(
    rows: list[StepMeasurement],
    path: Path,
    *,
    T: int | None = None,
    batch: int | None = None,
    budget_bytes: int | None = None,
) -> Path:
    """Save `demo_figure` as a PNG at ``path``; returns ``path``."""
    import matplotlib.pyplot as plt

    figure = demo_figure(rows, T=T, batch=batch, budget_bytes=budget_bytes)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def demo_figure(
    rows: list[StepMeasurement],
    *,
    T: int | None = None,
    batch: int | None = None,
    budget_bytes: int | None = None,
) -> Any:
    """Bar charts of the measured peak memory (the budget as a dashed line) and time per plan.

    Every bar carries its value as the table prints it; the title says T and the batch size.
    Returns the matplotlib figure (Agg backend).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spikeckpt.bench.report import byte_unit
    from spikeckpt.units import format_bytes

    names = [row.plan for row in rows]
    peaks = [row.peak_bytes for row in rows]
    unit, scale = byte_unit(max([*peaks, budget_bytes or 0]))
    figure, (memory, seconds) = plt.subplots(1, 2, figsize=(9, 3.8), layout="constrained")
    colours = ["grey", *["tab:blue"] * (len(rows) - 1)]
    bars = memory.bar(names, [p / scale for p in peaks], color=colours)
    memory.bar_label(bars, labels=[format_bytes(p) for p in peaks], padding=2)
    memory.set_ylabel(f"peak device memory, measured ({unit})")
    if budget_bytes:
        memory.axhline(budget_bytes / scale, color="tab:red", linestyle="--", linewidth=1.2)
        memory.annotate(
            f"budget {format_bytes(budget_bytes)}",
            (1.0, budget_bytes / scale),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            va="bottom",
            color="tab:red",
            fontsize=9,
        )
    times = [row.seconds for row in rows]
    bars = seconds.bar(names, times, color=colours)
    seconds.bar_label(bars, labels=[f"{t:.2f} s" for t in times], padding=2)
    seconds.set_ylabel("time per training step, measured (s)")
    for axis, top in ((memory, max([*peaks, budget_bytes or 0]) / scale), (seconds, max(times))):
        axis.set_ylim(0, top * 1.15)  # room for the labels
        axis.tick_params(axis="x", labelsize=8)
    shape = f", T={T}, batch {batch}" if T is not None and batch is not None else ""
    figure.suptitle(f"spikeckpt demo: one training step{shape}: plain BPTT vs the chosen plan")
    return figure
