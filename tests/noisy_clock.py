"""A pytest plugin that makes the library's timers see a busy machine.

Every interval the library times (the planner's probes, the layer-wise chunk timing, the
compile-or-not measurements) comes out scaled by a random factor, log-uniform in
``[1/F, F]``: a test whose outcome depends on those measurements fails under it, as it may
fail now and then on a loaded CI machine. Run the suite with it::

    PYTHONPATH=tests NOISY_CLOCK_FACTOR=5 NOISY_CLOCK_SEED=1 pytest -p noisy_clock

``NOISY_CLOCK_FACTOR``: ``F`` (default 3); ``NOISY_CLOCK_SEED``: the draws' seed (default 0,
plus the process id, so that xdist's workers draw apart). A test that fails under it and
compares choices made from separate measurements pins them (the ``quiet_costs`` fixture in
``tests/conftest.py``). Processes the tests start (DDP ranks, the command line) keep the
real clock.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import time
from typing import Any

import pytest

#: the modules whose ``time.perf_counter`` decides something (not the benchmarks' reports)
TIMED_MODULES = (
    "spikeckpt.engine.measure",
    "spikeckpt.planning.probe",
    "spikeckpt.engine.compiled",
    "spikeckpt.engine.auto_compile",
    "spikeckpt.wrapping",
)


class NoisyTime:
    """Stands for the ``time`` module: ``perf_counter`` advances by the real time since its
    last call times a random factor, log-uniform in ``[1 / factor, factor]`` (monotonic)."""

    def __init__(self, factor: float, seed: int) -> None:
        self._spread = math.log(factor)
        self._rng = random.Random(seed)
        self._last_real = time.perf_counter()
        self._reading = self._last_real

    def perf_counter(self) -> float:
        real = time.perf_counter()
        scale = math.exp(self._rng.uniform(-self._spread, self._spread))
        self._reading += (real - self._last_real) * scale
        self._last_real = real
        return self._reading

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def pytest_configure(config: pytest.Config) -> None:
    """Give each timed module its own noisy clock (seeded per process)."""
    factor = float(os.environ.get("NOISY_CLOCK_FACTOR", "3"))
    seed = int(os.environ.get("NOISY_CLOCK_SEED", "0")) + os.getpid()
    for k, name in enumerate(TIMED_MODULES):
        module = importlib.import_module(name)
        module.time = NoisyTime(factor, seed + k)  # type: ignore[attr-defined]
