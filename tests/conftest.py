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
