"""Shared test hygiene."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator

import pytest
from hypothesis import settings

#: CI (``CI`` set, as CI services and ``.ci/run`` set it) draws the same hypothesis examples
#: every run, so a submission's CI run is the run its author saw pass; a run without ``CI``
#: draws new ones (run the suite so, and the suites of the code you change with more
#: examples, to explore)
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
    """Restore SIGINT/SIGTERM handlers after each test. Lightning sets SIGINT to ``SIG_IGN``
    when a fit ends by ``KeyboardInterrupt`` (and to ``SIG_DFL`` after tearing down DDP); a
    child process started later inherits an ignored SIGINT, and Ctrl-C tests then hang."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for number, handler in saved.items():
        if handler is not None and signal.getsignal(number) is not handler:
            signal.signal(number, handler)


@pytest.fixture(autouse=True)
def _auto_compile_kept_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile="auto"`` compiles a stack step whose eager forward calls of one shape took 5 s
    (`spikeckpt.engine.auto_compile`); a test that runs a model that long would pay seconds of
    compiling and see inductor's round-off instead of bitwise gradients. The tests of the rule
    set their own threshold."""
    from spikeckpt.engine import auto_compile

    monkeypatch.setattr(auto_compile, "COMPILE_AFTER_SECONDS", math.inf)


#: the gather rule the library had when the tests of the gather path were written: a chunk
#: with at most 1/16 non-zeros gathers, whatever the widths and threads
PINNED_GATHER_RULE = ((0, 1 / 16),)


@pytest.fixture(autouse=True)
def _gather_rule_pinned(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests of the gather path use small widths, where the measured rule
    (`spikeckpt.adapters.affine.BREAK_EVEN`, by outputs per torch thread) never gathers, and
    run on any number of threads: each test runs with `PINNED_GATHER_RULE` unless it is marked
    ``measured_gather_rule``, which keeps the library's own (the tests of the rule itself)."""
    if request.node.get_closest_marker("measured_gather_rule") is None:
        from spikeckpt.adapters import affine

        monkeypatch.setattr(affine, "BREAK_EVEN", PINNED_GATHER_RULE)


@pytest.fixture
def quiet_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's measured times pinned to what a quiet core measures for the tests' small
    snnTorch net (24-32-5, batch 4; seconds): the probe's step costs and the layer-wise run's
    seconds per step and per chunk. Tests that compare choices ``plan="auto"`` made from
    separate measurements use it: those times are tens of microseconds, and a busy machine
    (CI's two workers) measures them 0.3-5x apart, enough to choose another plan or a fourth
    probe (found with every timer of the library scaled by a random factor in [1/5, 5])."""
    from spikeckpt.engine.measure import Probe
    from spikeckpt.planning import granularity
    from spikeckpt.plans.simulate import CostModel

    quiet = CostModel(forward=4.7e-4, backward=1.2e-3, write=1.9e-4, read=1.9e-4, segment=5.2e-4)
    monkeypatch.setattr(Probe, "costs", lambda self: quiet)
    monkeypatch.setattr(granularity, "layerwise_seconds", lambda *a, **k: (5e-5, 2e-3))
