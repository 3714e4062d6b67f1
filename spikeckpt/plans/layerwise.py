"""The cost model of the layer-wise granularity, next to the stack plans' (pure Python).

Layer-wise checkpointing ([`spikeckpt.engine.layerwise.layerwise_scan`][spikeckpt.engine.layerwise.layerwise_scan]) runs a
feed-forward stack of blocks in time chunks of ``chunk`` steps. The forward pass stores each
block's input spike train (packed) and its state at every chunk start; the backward pass
recomputes one block over one chunk at a time, top-down, chunks in reverse. Per block ``b``
(all sizes in bytes, for the whole batch):

- ``S_b`` its state, ``A_b`` what autograd keeps for one taped step of it (synapse and
  neuron), ``I_b`` one step of its input dense, ``O_b`` one step of its output dense;
- ``rho_b`` the density of its input spikes (``None``: not binary, stored dense).

Modeled peak on the device (``remote=True``: trains and states in host RAM or on disk)::

    sum_b 2 S_b                                 current states and their gradients
    + max_b chunk * (A_b + 2 I_b + O_b)         one block's tape over a chunk, its unpacked
                                                input chunk, the input gradient it hands down
                                                and the output gradient it receives

A [`MeasuredWorking`][spikeckpt.plans.layerwise.MeasuredWorking] given as ``working`` replaces the second line: the working set as
measured at a few chunk lengths (the whole training step's, the parameters' gradient sums
included), interpolated between them and extended past them by its slope.

With ``remote=False`` the packed trains and the chunk states stay on the device too and are
added. Off-device bytes: ``sum_b T * packed(I_b, rho_b) + (n_chunks - 1) * S'_b``, with
``S'_b`` the state as stored (a spike leaf bit-packed, `BlockSizes.stored_state`). Step
evaluations: every block runs each step twice (forward, recomputation), the same ``2T`` as
``Uniform``; the time model is ``T * (2 * forward + backward)`` plus the copies, in the units
of [`CostModel`][spikeckpt.plans.simulate.CostModel] (the stack's step times are used as the sum over blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spikeckpt.errors import ConfigError
from spikeckpt.plans.simulate import CostModel

__all__ = [
    "EXTRAPOLATION_MARGIN",
    "BlockSizes",
    "LayerwiseCost",
    "MeasuredWorking",
    "fitting_chunk",
    "layerwise_cost",
    "packed_bytes",
    "steepest_chord",
]

#: elements per index-list block (16-bit positions), as in `spikeckpt.storage.codecs`
_INDEX_BLOCK = 65536


def packed_bytes(dense_bytes: int, density: float | None, element_size: int = 4) -> int:
    """Bytes of a spike tensor of ``dense_bytes`` (``element_size`` bytes per element) stored
    with the ``auto`` codec at ``density`` (``None``: not binary, stored dense)."""
    if density is None:
        return dense_bytes
    if not 0.0 <= density <= 1.0:
        raise ConfigError(f"density must be in [0, 1] or None, got {density!r}")
    numel = dense_bytes // element_size
    bitpack = (numel + 7) // 8
    blocks = 0 if numel <= _INDEX_BLOCK else -(-numel // _INDEX_BLOCK)
    index = 2 * math.ceil(density * numel) + 4 * blocks
    return min(bitpack, index)


@dataclass(frozen=True)
class BlockSizes:
    """Measured sizes of one block at the batch being planned (bytes).

    Attributes:
        state_bytes: ``S_b``, the block's state.
        step_bytes: ``A_b``, bytes autograd keeps for one taped step of the block.
        input_bytes: ``I_b``, one step of the block's input, dense.
        output_bytes: ``O_b``, one step of the block's output, dense.
        density: fraction of ones in the block's input, or ``None`` when it is not binary.
        rng_bytes: what each chunk of the block keeps in memory to replay its random draws
            in the recomputation (a CPU block that draws: the CPU generator's state, 5,056
            bytes in torch), else 0.
        stored_state_bytes: the state as a chunk start is stored (a leaf that is the
            neuron's spikes, 0 or 1 by construction, bit-packed), or None: ``state_bytes``.
    """

    state_bytes: int
    step_bytes: int
    input_bytes: int
    output_bytes: int
    density: float | None = None
    rng_bytes: int = 0
    stored_state_bytes: int | None = None

    @property
    def stored_state(self) -> int:
        """Bytes of one stored chunk-start state (``stored_state_bytes``, else dense)."""
        return self.state_bytes if self.stored_state_bytes is None else self.stored_state_bytes


def steepest_chord(points: Sequence[tuple[int, int]], floor: int) -> int:
    """The steepest line between neighbouring ``(chunk, bytes)`` points, in bytes per chunk
    step (rounded up), and at least ``floor``."""
    chords = (
        -(-(wb - wa) // (kb - ka)) for (ka, wa), (kb, wb) in zip(points, points[1:], strict=False)
    )
    return max([floor, *chords])


#: Past the longest measured chunk the working set grows by the last chords' slope times
#: ``numerator / denominator``: the measured lengths end where the peak is still turning from
#: the gradient sums' to the tape's, and the tape grows faster than the last chord says
#: (measured, real step against the chord of the two longest probed lengths: 83 against
#: 69.6 KB per step, 1.19x, on 100-256-10 with a packed input on disk; 37.4 against 34.3 KB,
#: 1.09x, on the same net at batch 8 with host storage, where a 3x-smallest budget ran over by
#: 0.7% without the margin)
EXTRAPOLATION_MARGIN = (5, 4)


@dataclass(frozen=True)
class MeasuredWorking:
    """A layer-wise step's working set, measured at a few chunk lengths (bytes, whole batch).

    The peak of a step grows piecewise linearly with the chunk: at short chunks it is reached
    while the parameters' gradient sums are held (they do not grow with the chunk), at long
    ones while a block's tape over the chunk is. ``working(k)`` is the measured bytes at a
    measured length, the chord between two, the first one below them, and past the longest
    ``points[-1] + slope * (k - k_last)`` with the slope raised by `EXTRAPOLATION_MARGIN`:
    [`slope`][spikeckpt.plans.layerwise.MeasuredWorking.slope] bounds how fast any part of the
    peak grows (the steepest chord, at least the cost model's).

    Attributes:
        points: ``(chunk, bytes)`` measured, chunk lengths increasing, bytes not falling.
        base_slope: the least bytes per chunk step past the longest measured length (the
            cost model's ``max_b (A_b + 2 I_b + O_b)`` where blocks are taped, the growth
            measured on longer chunks where they run untaped).
        probe_bytes: the room the probe's first run (chunk 1, whole batch) needs beside
            what the call holds (its input, its state, a held ``.grad``): predicted from
            runs on fewer samples (with a margin), or the run's own bytes, whichever is
            more; a probe held under less runs nothing more (0: not known).
        short_slope: the least bytes per chunk step past the longest length of a probe
            that stopped short of these lengths (held under less room: `prefix`), where
            the longer ones show a line the shorter do not (an untaped step's buffers
            overtaking the gradient sums: the cost model's taped bytes); 0: none.
    """

    points: tuple[tuple[int, int], ...]
    base_slope: int
    probe_bytes: int = 0
    short_slope: int = 0

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("MeasuredWorking needs at least one measured (chunk, bytes) point")
        chunks = [k for k, _ in self.points]
        if chunks != sorted(set(chunks)) or chunks[0] < 1:
            raise ConfigError(f"measured chunk lengths must increase from 1 or more, got {chunks}")
        held = [w for _, w in self.points]
        if held != sorted(held):
            raise ConfigError(f"measured bytes must not fall as the chunk grows, got {held}")

    @property
    def slope(self) -> int:
        """Bytes per chunk step past the longest measured length. With one length measured
        (a probe held under a tight budget) no chord shows the growth: it is taken as the
        whole working set at that length per step, ``working(k) <= k * working(1)`` (an
        untaped block's buffers grow by 13 KB per step on a small Norse net whose probe
        measured chunk 1 alone; extrapolated flat, chunk 50 ran at 7x its budget)."""
        if len(self.points) == 1:
            return max(self.base_slope, -(-self.points[0][1] // self.points[0][0]))
        return steepest_chord(self.points, self.base_slope)

    def prefix(self, n: int) -> MeasuredWorking:
        """What a probe that measured only the first ``n`` lengths would have found."""
        n = max(1, n)
        if n >= len(self.points):
            return self
        # stopped short: past its longest length, at most what it holds per step there
        k, w = self.points[n - 1]
        slope = max(self.base_slope, self.short_slope, -(-w // k))
        return MeasuredWorking(self.points[:n], slope, self.probe_bytes, self.short_slope)

    def __call__(self, chunk: int) -> int:
        first, last = self.points[0], self.points[-1]
        if chunk <= first[0]:
            return first[1]
        if chunk >= last[0]:
            numerator, denominator = EXTRAPOLATION_MARGIN
            past = -(-self.slope * numerator // denominator)
            return last[1] + past * (chunk - last[0])
        for (ka, wa), (kb, wb) in zip(self.points, self.points[1:], strict=False):
            if ka <= chunk <= kb:
                return wa + -(-(wb - wa) * (chunk - ka) // (kb - ka))
        raise AssertionError("unreachable: chunk lies between the first and last points")

    def scaled(self, batch: int, probed: int) -> MeasuredWorking:
        """Measured at batch ``probed``, for a batch of ``batch`` (every byte scaled up, the
        fixed ones too: an over-estimate; never scaled down)."""
        if batch <= probed:
            return self

        def scale(n: int) -> int:
            return -(-n * batch // probed)

        points = tuple((k, scale(w)) for k, w in self.points)
        return MeasuredWorking(
            points, scale(self.base_slope), scale(self.probe_bytes), scale(self.short_slope)
        )


@dataclass(frozen=True)
class LayerwiseCost:
    """Modeled cost of a layer-wise run.

    Attributes:
        T: steps. chunk: steps per chunk. n_chunks: ``ceil(T / chunk)``.
        peak_bytes: modeled peak device bytes (see the module docstring).
        remote_bytes: bytes stored off the device (packed trains and chunk states); 0 when
            ``remote=False``.
        forward_steps: step evaluations of the whole stack (``2T``).
        time: modeled time in the [`CostModel`][spikeckpt.plans.simulate.CostModel]'s units.
    """

    T: int
    chunk: int
    n_chunks: int
    peak_bytes: int
    remote_bytes: int
    forward_steps: int
    time: float

    def time_factor(self, costs: CostModel) -> float:
        """Modeled time relative to BPTT's ``T * (forward + backward)``."""
        return self.time / (self.T * (costs.forward + costs.backward))


def layerwise_cost(
    T: int,
    chunk: int,
    blocks: Sequence[BlockSizes],
    *,
    remote: bool = True,
    costs: CostModel | None = None,
    working: MeasuredWorking | None = None,
    seconds: tuple[float, float] | None = None,
) -> LayerwiseCost:
    """Model a layer-wise run of ``blocks`` over ``T`` steps in chunks of ``chunk`` steps.

    ``costs.write`` / ``costs.read`` are the times to copy one whole stack state; the packed
    trains are charged in proportion to their bytes. ``working``: the measured working set
    (None: ``chunk * max_b (A_b + 2 I_b + O_b)``). ``seconds``: measured ``(per step, per
    chunk)`` times of the training step's layer-wise run (its fused neurons, synapses and
    copies included); the time is then ``T * per_step + chunks * per_chunk`` instead of the
    model from the stack's step times.
    """
    if T < 1 or chunk < 1:
        raise ConfigError(f"need T >= 1 and chunk >= 1, got T={T}, chunk={chunk}")
    if not blocks:
        raise ConfigError("need at least one block")
    costs = costs or CostModel()
    k = min(chunk, T)
    n_chunks = -(-T // k)
    states = sum(b.state_bytes for b in blocks)
    if working is None:
        held = max(k * (b.step_bytes + 2 * b.input_bytes + b.output_bytes) for b in blocks)
    else:
        held = working(k)
    trains = sum(T * packed_bytes(b.input_bytes, b.density) for b in blocks[1:])
    # the first block's input is the caller's tensor: referenced, never copied
    stored = trains + (n_chunks - 1) * sum(b.stored_state for b in blocks)
    # a drawing block's generator state per chunk stays in memory, whatever the tier, and the
    # backward keeps one more: where its own draws stand while recomputation replays others
    replay = n_chunks * sum(b.rng_bytes for b in blocks) + max(
        (b.rng_bytes for b in blocks), default=0
    )
    peak = 2 * states + held + (0 if remote else stored) + replay
    if seconds is not None:
        time = T * seconds[0] + n_chunks * seconds[1]
    else:
        time = T * (2 * costs.forward + costs.backward) + n_chunks * len(blocks) * costs.segment
    if remote and states > 0 and seconds is None:
        per_byte = (costs.write + costs.read) / states
        time += per_byte * stored
    return LayerwiseCost(
        T=T,
        chunk=k,
        n_chunks=n_chunks,
        peak_bytes=peak,
        remote_bytes=stored if remote else 0,
        forward_steps=2 * T,
        time=time,
    )


def fitting_chunk(
    T: int,
    blocks: Sequence[BlockSizes],
    budget_bytes: int,
    preferred: int,
    *,
    remote: bool = True,
    working: MeasuredWorking | None = None,
) -> int | None:
    """The largest chunk length ``<= preferred`` whose modeled peak fits ``budget_bytes``, or
    ``None`` when no chunk fits."""
    lo, hi = 1, max(1, min(preferred, T))

    def peak(k: int) -> int:
        return layerwise_cost(T, k, blocks, remote=remote, working=working).peak_bytes

    if any(b.rng_bytes for b in blocks):
        # a replay state per chunk shrinks as the chunks grow: the peak is not monotonic
        # and short chunks may not fit where longer ones do; every length is tried
        return next((k for k in range(hi, 0, -1) if peak(k) <= budget_bytes), None)
    if peak(lo) > budget_bytes:
        return None
    while lo < hi:  # the modeled peak grows with the chunk: bisect
        mid = (lo + hi + 1) // 2
        if peak(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
