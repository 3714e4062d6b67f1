"""``MemoryBudget``: a Lightning callback that plans every wrapped model to a device budget.

>>> trainer = L.Trainer(callbacks=[MemoryBudget("2GiB", storage="host")])  # doctest: +SKIP

Lifecycle (Lightning's conventions): arguments are checked in ``__init__``; ``setup`` finds
the [`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] modules; ``on_fit_start`` turns the budget into
bytes for the wrapped models' steps (minus the safety margin and what the model, gradients and
optimizer state take; the smallest over all ranks) and installs a
[`BudgetPlanner`][spikeckpt.planning.decide.BudgetPlanner] on each wrapped model. The plans themselves are
chosen at the first forward of each input shape, from a probe held under the budget,
identically on every rank; each step's plan covers the input train on the device, the
stacked outputs, the engine's gradient buffers and the activations
(`StepBytes`).

What the budget promises: every training step's device peak, the first included (parameters,
gradients, optimizer state, the input batch while it is on the device, and everything the step
allocates), stays within ``budget``: the one account of `spikeckpt.plans.account` for each
wrapped model's step, plus the model, its ``.grad`` and the optimizer state, counted once.
Measured steps ([`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter], with what the step holds
at entry counted through ``MemoryMeter.track``) are checked against it: a step that comes out
over makes the callback re-plan down by the overshoot.

Out of memory anyway (``max_retries > 0``, opt-in): the callback wraps the module's
``training_step`` and ``backward`` for the fit (put back at teardown) so a
``torch.OutOfMemoryError`` re-plans with ``retry_factor`` of the budget and runs the batch
again. By default it patches nothing.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim.swa_utils import AveragedModel

from spikeckpt.engine.function import (
    close_runs_since,
    most_open_runs,
    run_serial,
    watch_open_runs,
)
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.errors import ConfigError, SpikeckptError, UsageError
from spikeckpt.lightning.resources import (
    callback_copies,
    free_device_bytes,
    model_bytes,
    step_resident,
    tensor_bytes,
)
from spikeckpt.planning import BudgetPlanner, PlanChoice
from spikeckpt.plans.account import tier_note
from spikeckpt.storage.base import TIER_KINDS
from spikeckpt.units import format_bytes, parse_bytes
from spikeckpt.wrapping import CheckpointedSequence


class MemoryBudgetError(SpikeckptError, MisconfigurationException):
    """``MemoryBudget`` is misused (no wrapped model found, ...): Lightning's
    ``MisconfigurationException``, and a [`SpikeckptError`][spikeckpt.errors.SpikeckptError]."""


_HOW_TO_WRAP = (
    "wrap the spiking part of your LightningModule with spikeckpt.wrap, e.g.\n"
    "    self.net = spikeckpt.wrap(nn.Sequential(nn.Linear(700, 256), snn.Leaky(beta=0.9), ...))\n"
    "and call self.net(x) with x of shape (T, B, features) in training_step"
)


_FINDER_IGNORES_BUDGET = (
    "MemoryBudget: Lightning's batch size finder (Tuner.scale_batch_size, BatchSizeFinder) "
    "runs its trials before MemoryBudget plans (Lightning calls tuner callbacks first), so "
    "they run without the budget and the batch size it picks is not bounded by it: a fit "
    "with that batch size may be refused at its first step with BudgetTooSmall, which names "
    "the smallest budget that batch needs. Choose the batch size for the budget yourself "
    "(lower it until the first step is not refused), or give the budget that refusal names."
)


#: ``state_dict`` key (no module's name) of the bytes measured steps and out-of-memory
#: re-plans took off each planner
_CUT_KEY = "<measured cut bytes>"
_MEASURED_OVER = "measured steps came out over the plans"
_RESUMED_CUT = (
    "the fit this one resumes took it off the plans: its measured steps came out over them, "
    "or it ran out of memory and re-planned"
)
_OOM_RETRY = "out of memory: re-planned with less"


class MemoryBudget(Callback):
    """Pick checkpoint plans for every wrapped model so training fits a device memory budget.

    Args:
        budget: device budget for the whole training step, bytes or a string like ``"2GiB"``.
            When None, ``fraction`` of the device's free memory (CUDA ``mem_get_info``; on
            CPU the available RAM) is used.
        fraction: share of free device memory used when ``budget`` is None, in (0, 1].
        storage: tier for remote checkpoints, ``"host"``, ``"disk"`` or ``"device"`` (no
            off-device checkpoints); None keeps each wrapped model's own setting.
        margin: safety share of the budget left unplanned (default 0.05).
        remote: allow plans with off-device checkpoints (Double, TwoLevel).
        max_retries: re-plans with a tighter budget after an out-of-memory error in a step
            (default 0: none). With retries the callback wraps the module's
            ``training_step`` and ``backward`` for the fit (see the module docstring).
        retry_factor: budget multiplier at each re-plan.
        measure_batches: how many training batches (from the start, and after each re-plan or
            new input shape; with ``accumulate_grad_batches=k``, at least ``2k`` from the start
            and ``k`` after, so that a batch holding the optimizer's state and ``.grad`` from
            the batches before it is measured) are measured with [`MemoryMeter`][spikeckpt.engine.meter.MemoryMeter] and checked
            against the budget (slower while measuring on the CPU).
        verbose: print a summary on rank 0.

    On a CPU-only run the device *is* the host: the ``"host"`` tier's checkpoints and spike
    trains count against the budget (plans keep no off-device checkpoints), while
    ``storage="disk"`` keeps them off it. `tier_note` says which, and so does the log.

    Attributes:
        total_bytes: the whole step's budget (bytes; ``budget``, or ``fraction`` of the free
            memory).
        overhead_bytes: what the model holds for training: parameters, buffers, gradients and
            optimizer state (estimated before the first optimizer step).
        budget_bytes: the budget for the wrapped models' steps beyond the model (bytes): the
            total less the margin and ``overhead_bytes``.
        plans: wrapped module name -> the latest [`PlanChoice`][spikeckpt.planning.decide.PlanChoice]
            (plan with intervals, ``modeled_peak_bytes``, ``step``, ``time_factor``).
        measured_peak_bytes: device peak of the last measured training step, everything
            counted (MemoryMeter).
        retries: re-plans done after out-of-memory errors.
        replans: re-plans done because a measured step came out over the budget.
        tier_note: on a CPU run, which memory the storage tier is (None on a GPU).
    """

    def __init__(
        self,
        budget: int | str | None = None,
        *,
        fraction: float | None = None,
        storage: str | None = None,
        margin: float = 0.05,
        remote: bool = True,
        max_retries: int = 0,
        retry_factor: float = 0.8,
        measure_batches: int = 1,
        verbose: bool = True,
    ) -> None:
        if budget is not None and fraction is not None:
            raise ConfigError("give either budget= or fraction=, not both")
        self.budget = parse_bytes(budget) if budget is not None else None
        if fraction is None and budget is None:
            fraction = 0.8
        if fraction is not None and not (_is_number(fraction) and 0 < fraction <= 1):
            raise ConfigError(f"fraction must be in (0, 1], got {fraction!r}")
        self.fraction = fraction
        if storage is not None and storage not in TIER_KINDS:
            raise ConfigError(f"unknown storage {storage!r}: use one of {TIER_KINDS} or None")
        self.storage = storage
        if not _is_number(margin) or not 0 <= margin < 1:
            raise ConfigError(f"margin must be in [0, 1), got {margin!r}")
        self.margin = margin
        for name, flag in (("remote", remote), ("verbose", verbose)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        self.remote = remote
        for name, count in (("max_retries", max_retries), ("measure_batches", measure_batches)):
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {count!r}")
        if not _is_number(retry_factor) or not 0 < retry_factor < 1:
            raise ConfigError(f"retry_factor must be in (0, 1), got {retry_factor!r}")
        self.max_retries = max_retries
        self.retry_factor = retry_factor
        self.measure_batches = measure_batches
        self.verbose = verbose
        self.modules: dict[str, CheckpointedSequence] = {}
        self.planners: dict[str, BudgetPlanner] = {}
        self.budget_bytes = 0
        self.total_bytes = 0
        self.overhead_bytes = 0
        self._trainable: tuple[Any, ...] = ()
        #: bytes of the model copies other callbacks keep on the device (`callback_copies`)
        self._copies = 0
        self.measured_peak_bytes: int | None = None
        self.retries = 0
        self.replans = 0
        self.tier_note: str | None = None
        self._probes_at_start = 0
        self._cut_bytes = 0  # per planner: taken off by measured steps over it and OOM retries
        #: per wrapped model: why its part was cut, and what its refusals say of the cuts
        self._cut_why: dict[str, list[str]] = {}
        self._cut_said: dict[str, str] = {}
        self._pending: dict[str, Any] = {}
        self._to_measure = measure_batches
        self._cycle = 1  # the trainer's accumulate_grad_batches (batches per optimizer step)
        self._meter: MemoryMeter | None = None
        self._restore: list[Callable[[], None]] = []
        #: the last training_step's arguments and the random state it started from
        self._last_step_args: tuple[tuple[Any, ...], dict[str, Any], Any, int] = ((), {}, None, 0)
        self._retried_backward = False
        self._world_size = 1
        self._collectives_this_batch = 0
        self._runs_at_start: dict[str, int] = {}
        self._warned_runs: set[str] = set()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(budget=self.budget, fraction=self.fraction)

    @property
    def plans(self) -> dict[str, PlanChoice]:
        """Wrapped module name -> latest plan choice (modules not yet run are absent)."""
        return {n: p.last for n, p in self.planners.items() if p.last is not None}

    @property
    def modeled_step_bytes(self) -> int | None:
        """The whole step's planned device peak: the model's overhead plus the planned step
        of every wrapped model that tapes (None before one has run; a model run without
        anything to differentiate, as a frozen teacher, plans nothing)."""
        plans = self.plans
        if not plans:
            return None
        return self.overhead_bytes + sum(choice.step.total for choice in plans.values())

    # -- lifecycle -------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # a model that builds its layers in ``configure_model`` (Lightning's lazy way, called
        # after ``setup``) is looked at again in ``on_fit_start``
        lazy = type(pl_module).configure_model is not pl.LightningModule.configure_model
        self._find_modules(pl_module, required=not lazy)
        if stage == "fit" and any(
            isinstance(c, BatchSizeFinder) for c in getattr(trainer, "callbacks", ())
        ):
            rank_zero_warn(_FINDER_IGNORES_BUDGET)
        if stage == "fit" and self.max_retries > 0:
            if not pl_module.automatic_optimization:
                raise MemoryBudgetError(
                    f"MemoryBudget(max_retries={self.max_retries}) needs automatic optimization: "
                    f"{type(pl_module).__name__} sets automatic_optimization=False, and a "
                    "training_step that ran out of memory inside manual_backward cannot be "
                    "re-run (its optimizer steps and the code after the backward would run "
                    "twice). Pass max_retries=0 (the default), or a smaller budget= that "
                    "leaves room for what the step allocates outside the wrapped models."
                )
            self._install_retry(pl_module)

    def _find_modules(self, pl_module: pl.LightningModule, *, required: bool) -> None:
        """The wrapped models of ``pl_module`` (`modules`), set to this callback's tier."""
        # a compiled model (torch.compile) holds the wrapped one as ``_orig_mod``: named as
        # the attribute the user set (callback.plans["net"], not "net._orig_mod")
        # an average of the weights kept in the module (an EMA's AveragedModel) is updated
        # without autograd, never trained: a share of the budget for its copy of the wrapped
        # model halved the trained one's (its bytes count with the model's parameters)
        averaged = {name for name, m in pl_module.named_modules() if isinstance(m, AveragedModel)}
        self.modules = {
            ".".join(part for part in name.split(".") if part != "_orig_mod") or "<root>": module
            for name, module in pl_module.named_modules()
            if isinstance(module, CheckpointedSequence) and not _inside(name, averaged)
        }
        if not self.modules and required:
            raise MemoryBudgetError(
                f"MemoryBudget found no spikeckpt.CheckpointedSequence in "
                f"{type(pl_module).__name__}: {_HOW_TO_WRAP}"
            )
        for module in self.modules.values():
            if self.storage is not None and module.storage != self.storage:
                # the model's own tier is put back in teardown, as the planner is taken away
                def restore(m: CheckpointedSequence = module, kept: str = module.storage) -> None:
                    m.set_storage(kept)

                self._restore.append(restore)
                module.set_storage(self.storage)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        for module in self.modules.values():
            module.set_planner(None)
        self._drop_meter()

    def _drop_meter(self) -> None:
        """Close a step's meter without recording it."""
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A batch whose ``on_train_batch_start`` returned -1 (Lightning: skip the rest of the
        epoch) gets no ``on_train_batch_end``: its meter, opened for it, is closed here (it
        stayed active into the next epoch, every op slowed, its peak spanning both)."""
        self._drop_meter()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """A failed fit (a refused budget, an error in a step) gets no ``teardown`` call from
        Lightning: undo here what ``setup`` installed and close the step's meter, which would
        otherwise stay active in the process (a dispatch mode: every later op slowed down, and
        ``torch.compile`` skipped)."""
        self.teardown(trainer, pl_module, "fit")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        if not self.modules:  # built in configure_model, after setup
            self._find_modules(pl_module, required=True)
        self.planners = {}  # this fit's models (a callback reused for another module's fit)
        # each fit plans afresh: measure its start, through the second accumulation cycle
        # (the first whose batches hold the optimizer's state, and its last one `.grad` from
        # the batches before: with accumulate_grad_batches=2, batch 3 held 4.5-7.2% more
        # than the two measured, unchecked)
        self._cycle = max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1)
        self._to_measure = self._measured_after(self.measure_batches, start=True)
        total = self.budget
        if total is None:
            assert self.fraction is not None
            total = int(self.fraction * free_device_bytes(device))
        self._copies = self._copies_bytes(trainer, pl_module)
        overhead = model_bytes(pl_module, trainer.optimizers) + self._copies
        usable = int(total * (1 - self.margin)) - overhead
        if trainer.world_size > 1:
            reduced = trainer.strategy.reduce(
                torch.tensor(float(usable), dtype=torch.float64, device=device), reduce_op="min"
            )
            usable = int(reduced.item())
        # A budget that leaves nothing is refused by the planners at the first forward: only
        # then is what a step needs known (the input, the outputs, the smallest plan), so the
        # refusal can name a budget that works.
        usable = max(usable, 0)
        self.budget_bytes = usable
        self.total_bytes = total
        self.overhead_bytes = overhead
        self.tier_note = _tier_note({m.storage for m in self.modules.values()}, device)
        # what the fit this one resumes took off each planner's budget (measured steps over it,
        # out-of-memory re-plans): its saved plans were chosen with that much less
        self._cut_bytes = int(self._pending.get(_CUT_KEY, 0))
        self._cut_why, self._cut_said = {}, {}
        for name in self.modules:
            self.planners[name] = self._planner(trainer, device)
        if self._cut_bytes:
            self._take_off({name: self._cut_bytes for name in self.planners}, _RESUMED_CUT)
        for name, module in self.modules.items():
            if name in self._pending:
                self.planners[name].load_state_dict(self._pending[name])
            module.set_planner(self.planners[name])
        self._pending = {}  # a checkpoint's state resumes one fit, not the fits after it
        self._world_size = trainer.world_size
        self._trainable = _trainable(pl_module, trainer.optimizers)
        if self.verbose:
            rank_zero_info(
                f"MemoryBudget: {format_bytes(total)} budget, {format_bytes(overhead)} for the "
                f"model, gradients and optimizer, {format_bytes(usable)} for the steps of "
                f"{len(self.modules)} wrapped module(s) ({', '.join(self.modules)})"
            )
            if self.tier_note is not None:
                rank_zero_info(f"MemoryBudget: {self.tier_note}")

    def _planner(self, trainer: pl.Trainer, device: torch.device) -> BudgetPlanner:
        """A wrapped model's planner: its share of what the model leaves of the budget, the
        model's ``.grad`` counted with the model, refusals naming the whole budget."""
        modules, margin, overhead = len(self.modules), self.margin, self.overhead_bytes
        # (the overhead read when a refusal names its budget: layers unfrozen since change it)

        def total_for(need: int) -> int:
            """The budget whose share for one wrapped model is at least ``need`` bytes (and
            what measured steps showed the plans miss)."""
            need += self._cut_bytes
            now = self.overhead_bytes
            return math.ceil((now + modules * (need + 1) + 1) / (1 - margin)) + 1

        context = (
            f"; the model, its gradients and optimizer state take {format_bytes(overhead)}, "
            f"the margin {margin:.0%}"
        )
        if modules > 1:
            context += f", and {modules} wrapped models share the rest"
        distributed = trainer.world_size > 1
        return BudgetPlanner(
            self.budget_bytes // modules,
            remote=self.remote,
            grad_in_step=False,
            total_for=total_for,
            asked_bytes=self.total_bytes,
            context=context,
            reduce_max=self._counting(_reduce_max(trainer, device)) if distributed else None,
            broadcast=(lambda obj: trainer.strategy.broadcast(obj, src=0)) if distributed else None,
        )

    # -- measuring and logging ---------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._collectives_this_batch = 0
        self._retried_backward = False
        self._count_unfrozen(trainer, pl_module)
        self._probes_at_start = sum(p.probes for p in self.planners.values())
        self._runs_at_start = {name: p.runs for name, p in self.planners.items()}
        watch_open_runs()
        if self._to_measure > 0 and self._meter is None:
            self._meter = MemoryMeter(pl_module.device)
            self._meter.__enter__()
            self._meter.track(step_resident(pl_module, trainer.optimizers, batch))
            self._meter.track(callback_copies(_callbacks(trainer), pl_module, pl_module.device))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        measured = self._end_measuring()
        self._warn_runs(batch_idx)
        # a batch re-run from a failed backward holds what is left of that graph beside the
        # re-run (not what the plans missed: counted so, one out-of-memory cut the budget for
        # good); the next batch is measured instead
        if measured is not None and not self._retried_backward:
            self._check_measured(trainer, batch_idx, measured)
        # every logger, at the step Lightning's own ``self.log`` uses for this batch (as
        # DeviceStatsMonitor does: ``global_step`` has already counted this batch's optimizer
        # step, which put these metrics one row after the batch's own)
        step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")
            logger.log_metrics(self._metrics(measured, separator), step=step)
        if self.verbose and batch_idx == 0 and trainer.current_epoch == 0:
            self._print_plans(trainer)

    def _end_measuring(self) -> int | None:
        """Close this step's meter: its peak (None when the step was not measured); a step
        that planned a new shape makes the next one measured too."""
        peak = None
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            peak = self.measured_peak_bytes = self._meter.peak_bytes
            self._meter = None
            self._to_measure -= 1
        if sum(p.probes for p in self.planners.values()) > self._probes_at_start:
            # a new shape was planned in this step: measure the next step too
            again = self._measured_after(1 if peak is not None else self.measure_batches)
            self._to_measure = max(self._to_measure, again)
        return peak

    def _copies_bytes(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Bytes of the model copies other callbacks keep on the device (an EMA's
        ``AveragedModel``, SWA's average), counted with the model."""
        return tensor_bytes(callback_copies(_callbacks(trainer), pl_module, pl_module.device))

    def _count_unfrozen(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Layers unfrozen (or frozen) since the fit started, or parameters added to an
        optimizer (Lightning's ``BackboneFinetuning``): their gradients and optimizer state
        are counted again, the planners' shares changed by the difference, and the steps from
        here measured (one was 1.3x over its budget, unmeasured, before). Likewise a model
        copy another callback made or dropped (an EMA made at the first batch's end: three
        of them ran every step 1.19x over the budget, unmeasured, before)."""
        trainable = _trainable(pl_module, trainer.optimizers)
        copies = self._copies_bytes(trainer, pl_module)
        if (trainable == self._trainable and copies == self._copies) or not self.planners:
            return
        context = _UNFROZEN if trainable != self._trainable else _COPIES
        self._trainable, self._copies = trainable, copies
        overhead = model_bytes(pl_module, trainer.optimizers) + copies
        before = self.overhead_bytes
        self.overhead_bytes = overhead
        share = -(-(overhead - before) // len(self.planners))
        said = f"state take {format_bytes(before)}"
        for planner in self.planners.values():
            planner.replan(planner.budget_bytes - share, context=context)
            planner.context = planner.context.replace(said, f"state take {format_bytes(overhead)}")
        self.budget_bytes = sum(p.budget_bytes for p in self.planners.values())
        self._to_measure = max(self._to_measure, self._measured_after(self.measure_batches))

    def _measured_after(self, batches: int, *, start: bool = False) -> int:
        """How many batches to measure from here: ``batches``, and (``measure_batches`` > 0)
        at least one accumulation cycle (two at the fit's start), whose last batch begins with
        ``.grad`` held from the ones before it."""
        if self.measure_batches <= 0:
            return batches
        return max(batches, (2 if start else 1) * self._cycle)

    def _metrics(self, measured: int | None, separator: str = "/") -> dict[str, float]:
        """What the callback logs for this step (Lightning's ``Callback.hook/key`` names,
        ``/`` being the logger's ``group_separator``)."""
        prefix = f"{type(self).__name__}.on_train_batch_end{separator}"
        metrics: dict[str, float] = {}
        if measured is not None:
            metrics[f"{prefix}measured_peak_bytes"] = float(measured)
        modeled = self.modeled_step_bytes
        if modeled is not None:
            metrics[f"{prefix}modeled_step_bytes"] = float(modeled)
        for name, choice in self.plans.items():
            key = f"{prefix}{name}"
            metrics[f"{key}.modeled_peak_bytes"] = float(choice.modeled_peak_bytes)
            metrics[f"{key}.recompute_factor"] = float(choice.recompute_factor)
            metrics[f"{key}.time_factor"] = float(choice.time_factor)
            for attribute in ("interval", "slots", "remote_interval", "local_interval"):
                value = getattr(choice.plan, attribute, None)
                if isinstance(value, int):
                    metrics[f"{key}.{attribute}"] = float(value)
            stats = self.modules[name].last_stats
            for tier, moved in (stats.bytes_written if stats is not None else {}).items():
                if tier != "device":
                    metrics[f"{key}.bytes_to_{tier}"] = float(moved)
        return metrics

    def _print_plans(self, trainer: pl.Trainer) -> None:
        """One line per wrapped model: its plan and the whole step's budget, modeled and
        measured peak (through the progress bar, on its own line)."""
        whole = ""
        if self.measured_peak_bytes is not None:
            whole = (
                f"; whole step: budget {format_bytes(self.total_bytes)}, modeled "
                f"{format_bytes(self.modeled_step_bytes or 0)}, measured "
                f"{format_bytes(self.measured_peak_bytes)}"
            )
        bar = trainer.progress_bar_callback
        say = bar.print if bar is not None and trainer.is_global_zero else rank_zero_info
        for name, choice in self.plans.items():
            say(f"MemoryBudget[{name}]: {choice.summary()}{whole}")

    # -- resuming ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {n: planner.state_dict() for n, planner in self.planners.items()}
        if self._cut_bytes:
            state[_CUT_KEY] = self._cut_bytes
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict)
        for name, planner in self.planners.items():
            if name in state_dict:
                planner.load_state_dict(state_dict[name])

    # -- out of memory: re-plan and retry -------------------------------------------------------
    def _install_retry(self, pl_module: pl.LightningModule) -> None:
        step = pl_module.training_step
        backward = pl_module.backward

        def training_step(*args: Any, **kwargs: Any) -> Any:
            # the random state the step starts from: a retry draws what the first run drew
            # (Dropout's masks: other ones trained the batch otherwise)
            rng = _rng_state(pl_module.device)
            self._last_step_args = (args, kwargs, rng, run_serial())
            attempt = 0
            while True:
                try:
                    return step(*args, **kwargs)
                except torch.OutOfMemoryError as error:
                    self._replan(error, attempt)
                    attempt += 1
                    _set_rng_state(rng)

        def backward_with_retry(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            attempt = 0
            while True:
                marks = _grad_marks(pl_module)
                try:
                    return backward(loss, *args, **kwargs)
                except torch.OutOfMemoryError as error:
                    # the failed backward may have added to some .grad already (those of
                    # the layers after the wrapped models): undo it, or refuse to retry
                    _undo_partial_grads(pl_module, marks, error)
                    step_args, step_kwargs, rng, serial = self._last_step_args
                    # the failed graph stays referenced by Lightning's frames: let go of the
                    # wrapped models' checkpoints and stored trains in it before the re-run
                    # (held beside it, the re-run's step measured 1.7x a step's peak)
                    close_runs_since(serial)
                    self._retried_backward = True
                    self._replan(error, attempt)
                    attempt += 1
                    _set_rng_state(rng)
                    # in the context Lightning runs the step in (autocast under "bf16-mixed")
                    plugin = pl_module.trainer.strategy.precision_plugin
                    with plugin.train_step_context():
                        output = step(*step_args, **step_kwargs)
                    loss = _as_backward_loss(_rerun_loss(output), pl_module.trainer)

        pl_module.training_step = training_step  # type: ignore[method-assign]
        pl_module.backward = backward_with_retry  # type: ignore[method-assign]

        def undo() -> None:
            for attribute in ("training_step", "backward"):
                pl_module.__dict__.pop(attribute, None)

        self._restore.append(undo)

    def _replan(self, error: BaseException, attempt: int) -> None:
        if attempt >= self.max_retries:
            raise UsageError(
                f"MemoryBudget: out of memory after {self.max_retries} re-plan(s); the planned "
                f"budget is now {format_bytes(sum(p.budget_bytes for p in self.planners.values()))}. "
                "Lower the batch size, shorten the sequences, use storage='disk' or a smaller "
                "budget= that leaves room for what the model allocates outside the wrapped parts."
            ) from error
        if self._world_size > 1 and self._collectives_this_batch > 0:
            raise UsageError(
                "MemoryBudget: out of memory on this rank after all ranks planned this batch "
                "together; the other ranks have gone on to the gradient all-reduce, so the batch "
                "cannot be retried in lockstep. Under DDP give a budget= (or fraction=) well "
                "inside the smallest device instead of relying on re-plans."
            ) from error
        self.retries += 1
        cuts = [
            p.budget_bytes - int(p.budget_bytes * self.retry_factor) for p in self.planners.values()
        ]
        self._cut_bytes += max(cuts, default=0)  # kept in the checkpoint, as measured cuts
        self._take_off(dict(zip(self.planners, cuts, strict=True)), _OOM_RETRY)
        self._runs_at_start = {name: p.runs for name, p in self.planners.items()}  # the retry's
        self._to_measure = max(self._to_measure, self._measured_after(self.measure_batches))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rank_zero_warn(
            f"MemoryBudget: out of memory ({type(error).__name__}); re-planning with "
            f"{self.retry_factor:.0%} of the budget and retrying the batch "
            f"(retry {attempt + 1} of {self.max_retries})"
        )

    def _warn_runs(self, batch_idx: int) -> None:
        """Warn (once per wrapped model) when one ran more than once in a training step: each
        run is planned with the model's whole part of the budget, but the runs' tapes are all
        held until the backward."""
        ran = {n: p.runs - self._runs_at_start.get(n, p.runs) for n, p in self.planners.items()}
        # runs whose backward each ended before the next (an LBFGS closure evaluated again,
        # truncated BPTT) held one tape at a time: no warning
        if most_open_runs() <= sum(1 for runs in ran.values() if runs > 0):
            return
        for name, runs in ran.items():
            if runs <= 1 or name in self._warned_runs:
                continue
            self._warned_runs.add(name)
            check = (
                "measured steps re-plan down by what they exceed"
                if self.measure_batches > 0
                else "with measure_batches=0 nothing checks it"
            )
            rank_zero_warn(
                f"MemoryBudget: the wrapped model {name!r} ran {runs} times in training step "
                f"{batch_idx}, their tapes held together until a backward; each run is "
                f"planned with the model's whole part of the budget, so the step may exceed "
                f"the budget ({check}). Run it once per step (e.g. the views concatenated "
                f"along the batch), or give a budget= that allows for {runs} runs. (Runs whose "
                "backward each ends before the next, as an LBFGS closure's or truncated "
                "BPTT's with manual_backward per part, hold one tape at a time: no warning.)"
            )

    def _check_measured(self, trainer: pl.Trainer, batch_idx: int, peak: int) -> None:
        """Re-plan down when a measured step came out over the whole-step budget: each
        planner's budget shrinks by its share of the overshoot (and 1% of the budget more),
        its plans are dropped, and the next step is measured again."""
        limit = self.total_bytes
        if peak <= limit or not self.planners:
            return
        n, before = len(self.planners), self._cut_bytes
        # what the plans missed: the step's peak beyond the model's part and the steps the
        # plans made (a layer of yours before the wrapped model, a copy of the batch). Cut by
        # the overshoot alone, a plan with room under its budget was chosen again and the
        # step came out over again (3-5 steps in a row), and a refusal named a budget below
        # the peak already measured
        planned = self.overhead_bytes + sum(
            p.last.step.total for p in self.planners.values() if p.last is not None
        )
        missed = -(-(peak - planned + limit // 100) // n)  # per wrapped model, as the cuts
        cut = max(-(-(peak - limit + limit // 100) // n), missed - before)
        self._cut_bytes += cut
        why = {}
        for name, planner in self.planners.items():
            why[name] = _MEASURED_OVER
            runs = planner.runs - self._runs_at_start.get(name, planner.runs)
            if runs > 1:  # each run planned alone, their tapes held together
                why[name] += (
                    f": {name!r} ran {runs} times in a training step, each run planned with "
                    f"the whole budget: run it once per step, or allow for {runs} runs"
                )
        self._take_off(dict.fromkeys(self.planners, cut), why)
        self.replans += 1
        self._to_measure = max(self._to_measure, self._measured_after(self.measure_batches))
        rank_zero_warn(
            f"MemoryBudget: training step {batch_idx} measured {format_bytes(peak)}, over the "
            f"{format_bytes(limit)} budget by {format_bytes(peak - limit)}; re-planning with "
            f"{format_bytes(self.budget_bytes)} for the wrapped models' steps"
        )

    def _take_off(self, cuts: dict[str, int], why: str | dict[str, str]) -> None:
        """Re-plan each wrapped model with ``cuts[name]`` bytes (a part of the budget) less.
        Its refusals then say how much the cuts so far keep aside (``_cut_bytes``, which the
        budget they name adds back) and ``why``, so that their figures add up."""
        for name, planner in self.planners.items():
            reason = why if isinstance(why, str) else why[name]
            reasons = self._cut_why.setdefault(name, [])
            if reason not in reasons:
                reasons.append(reason)
            said = self._cut_said.get(name)
            if said:
                planner.context = planner.context.replace(said, "")
            said = (
                f"; {format_bytes(self._cut_bytes)} of its part kept aside for what the plans "
                f"miss ({'; '.join(reasons)})"
            )
            self._cut_said[name] = said
            planner.replan(planner.budget_bytes - cuts[name], context=said)
        self.budget_bytes = sum(p.budget_bytes for p in self.planners.values())

    def _counting(self, reduce: Callable[[int], int]) -> Callable[[int], int]:
        """Wrap a cross-rank reduction so the callback knows a collective ran this batch."""

        def counted(value: int) -> int:
            self._collectives_this_batch += 1
            return reduce(value)

        return counted


_COPIES = (
    "; other callbacks keep copies of the model on the device (an EMA's AveragedModel, SWA's "
    "average): they now count"
)

_UNFROZEN = (
    "; the model's trainable parameters changed during the fit (layers unfrozen, or added to "
    "an optimizer): their gradients and optimizer state now count"
)


def _trainable(pl_module: pl.LightningModule, optimizers: Any) -> tuple[Any, ...]:
    """Which parameters train: each one's ``requires_grad``, and the optimizers' parameters."""
    flags = tuple(p.requires_grad for p in pl_module.parameters())
    held = tuple(id(p) for o in optimizers for g in o.param_groups for p in g["params"])
    return flags, held


def _is_number(value: object) -> bool:
    """A real number (an int or a float, not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The CPU generator's state and, on a CUDA device, that device's."""
    index = (device.index or 0) if device.type == "cuda" else -1
    cuda = torch.cuda.get_rng_state(index) if index >= 0 else None
    return torch.get_rng_state(), cuda, index


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None, int]) -> None:
    cpu, cuda, index = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, index)


def _rerun_loss(output: Any) -> torch.Tensor:
    """The loss of ``training_step`` run again for a batch whose backward ran out of memory:
    a tensor, or a mapping's ``"loss"``, as Lightning reads the first run's (which gave one:
    Lightning called backward with it)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise UsageError(
            "MemoryBudget: training_step, run again for the batch whose backward ran out of "
            f"memory, returned {type(output).__name__} where its first run returned a loss; a "
            "retry needs the same batch to give a loss again (a step that skips batches at "
            "random cannot be retried: pass max_retries=0, or skip before computing a loss "
            "only on the first run)"
        )
    return loss


def _as_backward_loss(loss: torch.Tensor, trainer: pl.Trainer) -> torch.Tensor:
    """A re-run ``training_step``'s loss as Lightning hands it to ``backward``: divided by
    ``accumulate_grad_batches`` (Lightning's closure) and scaled by the precision plugin's
    gradient scaler, if it has one ("16-mixed" on CUDA)."""
    loss = loss / trainer.accumulate_grad_batches
    scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
    return scaler.scale(loss) if scaler is not None else loss


def _grad_marks(module: torch.nn.Module) -> dict[torch.nn.Parameter, tuple[int, int] | None]:
    """Each parameter's ``.grad`` before a backward: None, or its identity and version."""
    return {
        p: None if p.grad is None else (id(p.grad), p.grad._version) for p in module.parameters()
    }


def _undo_partial_grads(
    module: torch.nn.Module,
    marks: dict[torch.nn.Parameter, tuple[int, int] | None],
    error: BaseException,
) -> None:
    """Put back the ``.grad`` a backward that failed part-way left (a retried backward would
    add to it again): gradients that were None are None again; one that held a sum (gradient
    accumulation) and was added to cannot be put back without a copy, so the retry is
    refused."""
    changed = []
    for name, p in module.named_parameters():
        mark = marks.get(p)
        if mark is None:
            p.grad = None
        elif p.grad is None or (id(p.grad), p.grad._version) != mark:
            changed.append(name)
    if changed:
        raise UsageError(
            f"MemoryBudget: out of memory in backward after it had added to the accumulated "
            f"gradients of {len(changed)} parameter(s) ({', '.join(changed[:3])}, ...): the "
            "batch cannot be retried exactly (its gradient would count twice). With "
            "gradient accumulation (accumulate_grad_batches > 1) give a smaller budget= "
            "instead of relying on re-plans, or use accumulate_grad_batches=1."
        ) from error


def _reduce_max(trainer: pl.Trainer, device: torch.device) -> Callable[[int], int]:
    def reduce(value: int) -> int:
        tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
        return int(trainer.strategy.reduce(tensor, reduce_op="max").item())

    return reduce


def _tier_note(storages: set[str], device: torch.device) -> str | None:
    """On a CPU-only run, which memory the storage tiers are (None on a GPU)."""
    notes = [tier_note(storage, device.type) for storage in sorted(storages)]
    return "; ".join(n for n in notes if n) or None


def _callbacks(trainer: pl.Trainer) -> list[Any]:
    """The trainer's callbacks (``Trainer.callbacks``, set when it is built)."""
    return list(getattr(trainer, "callbacks", ()))


def _inside(name: str, parents: set[str]) -> bool:
    """Whether the module named ``name`` lies inside one of the modules named ``parents``."""
    return any(name == p or name.startswith(p + ".") for p in parents if p)
