"""Shared test hygiene."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


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
