"""Measure one training step: peak device bytes, time, step evaluations, gradient error.

- **Memory**: [`spikeckpt.MemoryMeter`][spikeckpt.engine.meter.MemoryMeter] around one training step (the only memory
  measure on the CPU: live tensor bytes through a dispatch mode), plus the parameters' bytes
  (they live on the device too). The input spike train is made before and not counted: it
  would stay on the host (``scan`` moves one slice per step); the same holds for every
  strategy. The meter slows ops down, so memory and time come from separate runs.
- **Time**: ``time.perf_counter`` around unmetered steps, median of ``repeats`` (seconds).
- **Evaluations**: calls of the model's step function in the metered run (forward pass and
  recomputation), per time step.
- **Gradients**: the largest ``|g - g_bptt|`` over every parameter element, absolute and
  relative to the largest ``|g_bptt|`` of that parameter.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from spikeckpt import plans
from spikeckpt.bench.strategies import Context, NoPlanFits, Strategy, Workload
from spikeckpt.engine.meter import MemoryMeter
from spikeckpt.engine.saved import measure_step
from spikeckpt.storage.base import tensor_nbytes

__all__ = [
    "Measurement",
    "calibrate",
    "choose_threads",
    "make_context",
    "measure",
    "grad_error",
    "param_bytes",
    "scratch_directory",
]


@dataclass
class Measurement:
    """One strategy at one length and width. Sizes in bytes, times in seconds.

    ``fits`` is false when the strategy could not run (no plan fits the plan budget, or not
    available); the numbers are then ``None``.
    """

    strategy: str
    label: str
    T: int
    hidden: int
    batch: int
    plan: str
    fits: bool
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    modeled_bytes: int | None = None
    time_s: float | None = None
    time_per_step_s: float | None = None
    evals_per_step: float | None = None
    bytes_off_device: int | None = None
    max_abs_grad_diff: float | None = None
    max_rel_grad_diff: float | None = None
    peak_ratio: float | None = None
    time_ratio: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def choose_threads(threads: int | None = None) -> tuple[int, str]:
    """Set ``torch.set_num_threads`` and say why: 1 when the machine is loaded.

    Args:
        threads: force this many; ``None``: 1 if the 1-minute load average is at least half
            the CPU count, else the CPU count.

    Returns:
        ``(threads, reason)``.
    """
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if threads is None:
        threads = 1 if load >= 0.5 * cores else cores
        reason = f"load average {load:.2f} on {cores} cores"
    else:
        reason = "--threads"
    torch.set_num_threads(max(1, threads))
    return torch.get_num_threads(), reason


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters."""
    return sum(tensor_nbytes(p) for p in model.parameters())


def make_context(
    workload: Workload,
    T: int,
    *,
    plan_budget: int | None,
    costs: plans.CostModel,
    directory: str | None,
    device: torch.device | None = None,
) -> Context:
    """Build the model, the input and the probed ``S``/``A`` for one run."""
    device = device or torch.device("cpu")
    model = workload.model().to(device)
    x = workload.spikes(T).to(device)
    state = model.initial_state(workload.batch)
    # The input slice is a view of x (made outside the measured step): exclude it from A.
    probe = measure_step(model.step, state, x[0], [*model.parameters(), x])
    return Context(model, x, probe.state_bytes, probe.step_bytes, plan_budget, costs, directory)


def _counted(step: Callable[[Any, Tensor], Any]) -> tuple[Callable[[Any, Tensor], Any], list[int]]:
    calls = [0]

    def counted(state: Any, x_t: Tensor) -> Any:
        calls[0] += 1
        return step(state, x_t)

    return counted, calls


def _grads(model: torch.nn.Module) -> list[Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]


def grad_error(grads: list[Tensor], reference: list[Tensor]) -> tuple[float, float]:
    """``(max |g - ref|, max over tensors of max|g - ref| / max|ref|)``."""
    abs_err, rel_err = 0.0, 0.0
    for g, r in zip(grads, reference, strict=True):
        diff = (g - r).abs().max().item()
        scale = r.abs().max().item()
        abs_err = max(abs_err, diff)
        rel_err = max(rel_err, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return abs_err, rel_err


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    strategy: Strategy,
    ctx: Context,
    *,
    repeats: int = 3,
    reference: list[Tensor] | None = None,
    time_it: bool = True,
) -> tuple[Measurement, list[Tensor] | None]:
    """Run ``strategy`` on ``ctx``: one metered step, then ``repeats`` timed ones.

    Returns:
        The measurement and the gradients of the metered run (``None`` when it did not run).
    """
    model = ctx.model
    hidden = model.widths[1]
    row = Measurement(strategy.name, strategy.label, ctx.T, hidden, int(ctx.x.shape[1]), "-", False)
    if strategy.run is None:
        row.note = strategy.note
        return row, None
    device = ctx.x.device
    step, calls = _counted(model.step)
    model.zero_grad(set_to_none=True)
    try:
        with MemoryMeter(device) as meter:
            outcome = strategy.run(ctx, step)
        _sync(device)
    except NoPlanFits as error:
        row.note = str(error)
        return row, None
    grads = _grads(model)
    row.fits = True
    row.plan = outcome.plan
    row.peak_bytes = meter.peak_bytes + param_bytes(model)
    # budget and modeled peak as whole steps, like the measured peak: plus the parameters
    # and their gradients (what the plan budget leaves out)
    fixed = 2 * param_bytes(model)
    if outcome.budget_bytes is not None:
        row.budget_bytes = outcome.budget_bytes + fixed
    if outcome.modeled_bytes is not None:
        row.modeled_bytes = outcome.modeled_bytes + fixed
    # layer-wise runs its blocks, not model.step: it reports its own step count
    row.evals_per_step = (calls[0] or outcome.forward_steps or 0) / ctx.T
    row.bytes_off_device = outcome.bytes_off_device
    row.note = "; ".join(filter(None, (strategy.note, outcome.note)))
    if reference is not None:
        row.max_abs_grad_diff, row.max_rel_grad_diff = grad_error(grads, reference)
    if time_it:
        times = []
        for _ in range(max(1, repeats)):
            model.zero_grad(set_to_none=True)
            _sync(device)
            start = time.perf_counter()
            strategy.run(ctx, model.step)
            _sync(device)
            times.append(time.perf_counter() - start)
        row.time_s = statistics.median(times)
        row.time_per_step_s = row.time_s / ctx.T
    model.zero_grad(set_to_none=True)
    return row, grads


@contextlib.contextmanager
def scratch_directory(parent: str | None = None) -> Iterator[str]:
    """The parent folder of the disk tier's stores (default: the system temporary folder).

    Each store makes its own private folder there and removes it, on SIGTERM too (the disk
    tier's handler); a folder of the bench's own around them outlived a ``kill`` or
    ``timeout``: an empty ``spikeckpt-bench-*`` was left at each."""
    yield parent if parent is not None else tempfile.gettempdir()


def calibrate(workload: Workload, directory: str, *, steps: int = 64) -> plans.CostModel:
    """Measured operation times in units of one forward step, for the planner's time model.

    ``forward``: 1. ``backward``: (BPTT step time - untaped forward time) per step.
    ``write``: the blocking part of one state's disk write (``put``: packing, and the write
    itself for states up to the disk tier's ``background_bytes``, else the hand-off to its I/O
    thread); ``read``: one ``get`` without prefetch (an upper bound for large states, which the
    executor prefetches). ``segment``: the fixed cost of one
    backward call (`spikeckpt.planning.segment_seconds`).
    """
    from spikeckpt.planning import SEGMENT_PROBE_STEPS, segment_seconds
    from spikeckpt.storage.base import Ledger
    from spikeckpt.storage.tiers import make_store

    model = workload.model()
    x = workload.spikes(steps)
    state = model.initial_state(workload.batch)

    def forward() -> None:
        s = state
        with torch.no_grad():
            for x_t in x:
                s, _ = model.step(s, x_t)

    def bptt() -> None:
        s = state
        total = None
        for x_t in x:
            s, y = model.step(s, x_t)
            total = y if total is None else total + y
        assert total is not None
        loss_of = (total / steps - 0.1).square().mean()
        loss_of.backward()

    def best(fn: Callable[[], None], n: int = 3) -> float:
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    c_f = best(forward) / steps
    c_fb = best(bptt) / steps
    model.zero_grad(set_to_none=True)
    store = make_store("disk", torch.device("cpu"), Ledger(), directory=directory)
    leaves = [t.clone() for layer in state for t in layer]
    try:
        writes, reads = [], []
        for key in range(5):
            start = time.perf_counter()
            store.put(key, leaves)
            writes.append(time.perf_counter() - start)
            store.flush()  # type: ignore[attr-defined]
            start = time.perf_counter()
            store.get(key)
            reads.append(time.perf_counter() - start)
            store.drop(key)
    finally:
        store.close()
    backward = max(c_fb - c_f, 0.1 * c_f) / c_f
    params = [p for p in model.parameters() if p.requires_grad]
    segment = segment_seconds(model.step, state, x[:SEGMENT_PROBE_STEPS], params)
    model.zero_grad(set_to_none=True)
    return plans.CostModel(
        forward=1.0,
        backward=round(backward, 3),
        write=round(statistics.median(writes) / c_f, 3),
        read=round(statistics.median(reads) / c_f, 3),
        segment=round(segment / c_f, 3),
    )
