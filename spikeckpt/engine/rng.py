"""Random-number generator states: captured before a step, restored to replay it exactly.

The one place the engine (and the layers above it) handle RNG: which CUDA devices a run
touches (`cuda_devices`), and a capture/restore pair (`RngState`), as
``torch.utils.checkpoint`` does. The backward phase runs inside `backward_draws` over those
devices: restoring states there never changes the generators the caller sees, which end where
the backward functions' own draws (a noisy surrogate gradient) leave them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from spikeckpt.engine.meter import count_made
from spikeckpt.errors import ConfigError

__all__ = [
    "CPU_STATE_BYTES",
    "RngState",
    "backward_draws",
    "cuda_devices",
    "refuse_own_generators",
    "rejoin_backward_draws",
]

#: bytes of the CPU generator's state (``torch.get_rng_state()``: 5,056 in torch 2.x), which
#: a capture holds
CPU_STATE_BYTES = torch.get_rng_state().nbytes


def cuda_devices(tensors: Iterable[Tensor]) -> list[int]:
    """The sorted CUDA device indices of ``tensors`` (empty on the CPU; other leaves, such as
    the ``None`` of a state step 0 builds, are skipped)."""
    return sorted({t.device.index or 0 for t in tensors if isinstance(t, Tensor) and t.is_cuda})


@dataclass(frozen=True)
class RngState:
    """CPU and CUDA generator states, captured before a step."""

    cpu: Tensor
    cuda: tuple[tuple[int, Tensor], ...] = ()

    @staticmethod
    def capture(devices: Sequence[int]) -> RngState:
        """The generator states now: the CPU's and those of the CUDA ``devices``."""
        cuda = tuple((d, torch.cuda.get_rng_state(d)) for d in devices)
        cpu = torch.get_rng_state()
        count_made([cpu, *(state for _, state in cuda)])  # made without an op: meters count it
        return RngState(cpu, cuda)

    def restore(self) -> None:
        """Set the generators back to the captured states (inside a backward phase, first
        keeping the position of its own draws: `backward_draws`)."""
        if _BACKWARD_DRAWS:
            _BACKWARD_DRAWS[-1].leave()
        self.set()

    def set(self) -> None:
        """Set the generators to the captured states."""
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda:
            torch.cuda.set_rng_state(state, device)

    def same_as(self, other: RngState) -> bool:
        """Whether both captures hold the same generator states (nothing drew in between)."""
        if len(self.cuda) != len(other.cuda) or not torch.equal(self.cpu, other.cpu):
            return False
        return all(
            d == e and torch.equal(a, b)
            for (d, a), (e, b) in zip(self.cuda, other.cuda, strict=True)
        )


def refuse_own_generators(
    generators: Sequence[torch.Generator], before: Sequence[Tensor], who: str, way: str
) -> None:
    """Raise when a forward pass drew from a ``torch.Generator`` of the user's own
    (``before``: each one's state at its start) in a run that recomputes steps: the engine
    replays torch's default generators (CPU and CUDA) only, so the recomputed steps would draw
    other numbers and the gradient would be wrong. ``who``: the run (named in the message);
    ``way``: the way forward."""
    for gen, state in zip(generators, before, strict=True):
        if not torch.equal(gen.get_state(), state):
            raise ConfigError(
                f"{who} recomputes steps in the backward pass, and the forward drew from a "
                f"torch.Generator of its own (on {gen.device}), which it cannot replay (the "
                f"gradient would be wrong): it replays torch's default generators only; {way}"
            )


class _BackwardDraws:
    """Where the draws of one backward phase's own functions stand: at the generators
    (``kept`` None) or, after a recomputation restored forward states, in ``kept``."""

    def __init__(self, devices: Sequence[int]) -> None:
        self.devices = list(devices)
        self.kept: RngState | None = None

    def leave(self) -> None:
        """The generators are about to be set elsewhere: keep the stream's position."""
        if self.kept is None:
            self.kept = RngState.capture(self.devices)

    def rejoin(self) -> None:
        """Put the generators back at the stream's position."""
        if self.kept is not None:
            self.kept.set()
            self.kept = None


_BACKWARD_DRAWS: list[_BackwardDraws] = []  # the backward phases running (nested)


@contextlib.contextmanager
def backward_draws(devices: Sequence[int]) -> Iterator[None]:
    """Around a run's backward phase (in place of ``torch.random.fork_rng``): the random
    numbers its backward functions draw (a surrogate that adds noise to its gradient,
    snnTorch's ``SSO``) continue one stream from the generators' states at its start, whatever
    the recomputation restores in between (`rejoin_backward_draws`), and the caller's generators end
    where that stream ends, as after the plain loop's backward (before, they were put back
    where they were: with no other draws, every training step drew the same noise). Nothing is
    captured unless a recomputation restores states (a forward that drew)."""
    draws = _BackwardDraws(devices)
    _BACKWARD_DRAWS.append(draws)
    try:
        yield
    finally:
        _BACKWARD_DRAWS.remove(draws)
        draws.rejoin()


def rejoin_backward_draws() -> None:
    """Before backpropagating a recomputed segment: its draws come from the backward stream
    (`backward_draws`). No-op outside a backward phase."""
    if _BACKWARD_DRAWS:
        _BACKWARD_DRAWS[-1].rejoin()


@contextlib.contextmanager
def kept_generators(module: object) -> Iterator[None]:
    """Put back, on leaving, the state of every ``torch.Generator`` that ``module``'s layers
    hold as attributes (noise made reproducible with a generator of its own): a probe that
    runs the model draws nothing from them, as ``torch.random.fork_rng`` keeps the default
    generators. No change where ``module`` is not an ``nn.Module``."""
    layers = module.modules() if isinstance(module, torch.nn.Module) else ()
    own = {id(v): v for m in layers for v in vars(m).values() if isinstance(v, torch.Generator)}
    with generators_kept(own.values()):
        yield


@contextlib.contextmanager
def generators_kept(generators: Iterable[torch.Generator]) -> Iterator[None]:
    """Put back, on leaving, the state of each of ``generators``: what runs inside (a probe,
    a measured step) draws nothing from them, as far as the run after it can tell."""
    states = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)
