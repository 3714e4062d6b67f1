"""What a run did: one stats type for every granularity.

[`ScanStats`][spikeckpt.engine.stats.ScanStats] is what [`spikeckpt.scan`][spikeckpt.engine.scan.scan]'s result holds ([`ScanResult`][spikeckpt.engine.stats.ScanResult]:
``out.stats``) and what a wrapped model keeps in ``last_stats``; a layer-wise run reports the
same fields as a [`LayerwiseStats`][spikeckpt.engine.stats.LayerwiseStats] (``granularity == "layer"``, plus the per-block spike-train figures in
``blocks``). Backward-phase fields fill in when backward runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from spikeckpt.plans.account import StepBytes
from spikeckpt.plans.simulate import Cost
from spikeckpt.storage.base import Ledger

__all__ = ["BlockStats", "LayerwiseStats", "ScanResult", "ScanStats"]


@dataclass
class BlockStats:
    """What a layer-wise forward pass stored for one block's input spike train.

    Attributes:
        name: the neuron's path in the model.
        ones: number of nonzero input elements seen (all chunks).
        elements: number of input elements seen.
        dense_bytes: bytes of the input train dense (its dtype).
        stored_bytes: bytes the tier holds for it after its codec (0 for the first block,
            whose input is referenced, not stored).
        codecs: chunks stored per codec (``"bitpack"``, ``"index"``, ``"dense"``;
            ``"reference"`` for the first block, ``"device"`` for the device tier).
        binary: whether every chunk was exactly binary (0/1).
        neuron_chunks: how the neuron ran, chunks per way in the forward pass: ``"fused"``
            (its chunk kernel, `spikeckpt.engine.fused`), ``"compiled"`` (that kernel
            compiled) or ``"per-step"`` (one call per step).
        untaped_chunks: chunks whose recomputation and backward ran without autograd (an
            affine synapse into a fused neuron, `spikeckpt.engine.direct`); the others
            were taped and backpropagated by autograd.
    """

    name: str
    ones: int = 0
    elements: int = 0
    dense_bytes: int = 0
    stored_bytes: int = 0
    codecs: dict[str, int] = field(default_factory=dict)
    binary: bool = True
    neuron_chunks: dict[str, int] = field(default_factory=dict)
    untaped_chunks: int = 0

    def count_neuron(self, way: str) -> None:
        """One more chunk run ``way`` (see ``neuron_chunks``)."""
        self.neuron_chunks[way] = self.neuron_chunks.get(way, 0) + 1

    @property
    def neuron(self) -> str:
        """How the neuron ran: ``"fused"``, ``"compiled"``, ``"per-step"``, or the mix, e.g.
        ``"fused (19 chunks), per-step (1)"``; ``""`` before a run."""
        ways = sorted(self.neuron_chunks.items(), key=lambda kv: -kv[1])
        if len(ways) <= 1:
            return ways[0][0] if ways else ""
        first, *rest = ways
        return ", ".join([f"{first[0]} ({first[1]} chunks)", *(f"{w} ({n})" for w, n in rest)])

    @property
    def density(self) -> float:
        """Measured fraction of nonzero input elements (spike density)."""
        return self.ones / self.elements if self.elements else 0.0

    @property
    def saved_bytes(self) -> int:
        """Bytes the codecs saved: dense bytes minus stored bytes (stored inputs only)."""
        return self.dense_bytes - self.stored_bytes if self.stored_bytes else 0

    @property
    def ratio(self) -> float:
        """Stored bytes / dense bytes (0 when nothing was stored)."""
        return self.stored_bytes / self.dense_bytes if self.dense_bytes else 0.0


@dataclass
class ScanStats:
    """What one run did (``scan``, a wrapped model's forward, a layer-wise run).

    Attributes:
        plan: description of the plan (``"BPTT()"``, ``"Uniform(interval=50)"``, a
            layer-wise run: ``"layer-wise(chunk=20)"``).
        schedule: the schedule executed (``None`` on the no-grad path and for layer-wise).
        T: number of steps.
        storage: the remote tier (``"host"``, ``"disk"`` or ``"device"``).
        granularity: ``"stack"`` (the whole model is one step) or ``"layer"``.
        state_bytes: ``S``, bytes of the initial state's tensors (all layers).
        tape_bytes_per_step: measured ``A``: bytes saved by autograd per taped step (mean;
            stack granularity).
        forward_steps: step evaluations, forward pass and recomputation (layer-wise: neuron
            steps summed over blocks).
        backward_steps: steps backpropagated (``T`` after backward; layer-wise: per block).
        predicted: the simulator's [`Cost`][spikeckpt.plans.simulate.Cost] of the schedule.
        ledger: executor ledger: ``peak["device"]`` follows the simulator's convention,
            remote tiers count states at their unpacked size (stack granularity).
        storage_ledger: the tiers' own ledger (actual bytes held and moved, after codecs).
        completed: whether backward ran to the end.
        chunk: layer-wise steps per chunk (0 for the stack granularity).
        n_chunks: layer-wise chunks (0 for the stack granularity).
        blocks: layer-wise: one [`BlockStats`][spikeckpt.engine.stats.BlockStats] per block, bottom-up (empty for stack).
        backward_chunks: layer-wise (chunk, block) pairs backpropagated.
        planned: the step as planned for a budget ([`StepBytes`][spikeckpt.plans.account.StepBytes]:
            input, outputs, gradients, activations; None without a budget).
        note: which memory the storage tier is when it counts against the budget (a CPU
            run's host tier), None otherwise.
        step_compiled: the stack granularity's step ran compiled (``compile=True``,
            `spikeckpt.engine.compiled_step`).
        planning_seconds: seconds the call spent choosing its plan, probes of the model
            included (the first call of a shape; near 0 when a plan is reused).
            A benchmark times calls where it is near 0.
    """

    plan: str
    schedule: Any
    T: int
    storage: str
    granularity: str = "stack"
    state_bytes: int = 0
    tape_bytes_per_step: float = 0.0
    forward_steps: int = 0
    backward_steps: int = 0
    predicted: Cost | None = None
    ledger: Ledger = field(default_factory=Ledger)
    storage_ledger: Ledger = field(default_factory=Ledger)
    completed: bool = False
    chunk: int = 0
    n_chunks: int = 0
    blocks: list[BlockStats] = field(default_factory=list)
    backward_chunks: int = 0
    planned: StepBytes | None = None
    note: str | None = None
    step_compiled: bool = False
    planning_seconds: float = 0.0

    @property
    def recompute_factor(self) -> float:
        """Step evaluations per time step (1.0 means no recomputation)."""
        return self.forward_steps / self.T if self.T else 0.0

    @property
    def peak_bytes(self) -> dict[str, int]:
        """Peak bytes per tier (ledger convention)."""
        return dict(self.ledger.peak)

    @property
    def bytes_written(self) -> dict[str, int]:
        """Bytes copied into each storage tier."""
        return dict(self.storage_ledger.written)

    @property
    def bytes_read(self) -> dict[str, int]:
        """Bytes copied out of each storage tier."""
        return dict(self.storage_ledger.read)

    @property
    def densities(self) -> list[float]:
        """Measured input spike density per block (layer-wise; empty for stack)."""
        return [b.density for b in self.blocks]

    @property
    def saved_bytes(self) -> int:
        """Bytes saved by the codecs over all blocks (layer-wise; 0 for stack)."""
        return sum(b.saved_bytes for b in self.blocks)


@dataclass
class LayerwiseStats(ScanStats):
    """A layer-wise run's [`ScanStats`][spikeckpt.engine.stats.ScanStats] (``granularity == "layer"``): the same fields."""

    granularity: str = "layer"


class ScanResult(tuple):
    """What a run returns: a pair ``(ys, state)``, with the run's stats beside it.

    ``ys, state = spikeckpt.scan(...)`` unpacks it whatever else was asked; ``out.stats``
    is the run's [`ScanStats`][spikeckpt.engine.stats.ScanStats] ([`LayerwiseStats`][spikeckpt.engine.stats.LayerwiseStats] for a layer-wise run).

    Attributes:
        ys: the outputs (stacked ``(T, ...)`` or the readout's value).
        state: the final state.
        stats: what the run did (backward-phase fields fill in when backward runs).
    """

    stats: ScanStats

    def __new__(cls, ys: Any, state: Any, stats: ScanStats) -> ScanResult:
        self = super().__new__(cls, (ys, state))
        self.stats = stats
        return self

    @property
    def ys(self) -> Any:
        """The outputs."""
        return self[0]

    @property
    def state(self) -> Any:
        """The final state."""
        return self[1]

    def legacy(self, stats: bool, caller: str) -> Any:
        """``self``, or the old ``(ys, state, stats)`` triple (with a ``DeprecationWarning``)
        when the caller asked ``stats=True``."""
        if not stats:
            return self
        warnings.warn(
            f"{caller}(..., stats=True) is deprecated: {caller} returns (ys, state) with the "
            f"stats beside them; use out = {caller}(...); ys, state = out; out.stats",
            DeprecationWarning,
            stacklevel=3,
        )
        return self[0], self[1], self.stats
