"""Ctrl-C in the command line: one line, exit status 130, never ignored.

Python turns SIGINT into a ``KeyboardInterrupt`` at whatever line the main thread runs. Two
places would lose it:

- a ``weakref.finalize`` callback or a ``__del__`` method (``MemoryMeter`` runs a finalizer
  for every tensor it has seen): Python swallows the exception there ("Exception ignored
  in: <finalize object ...>") and the command goes on;
- a library that catches it (Lightning's ``Trainer`` catches it, tears down and calls
  ``sys.exit(1)``).

`Interrupts` handles SIGINT for the command line: it raises ``KeyboardInterrupt`` only
outside finalizers (inside one it asks for the signal again a moment later), turns a
swallowed one into a new signal (``sys.unraisablehook``), remembers that it came (so a
library's ``sys.exit`` after it still ends as an interruption) and ignores further Ctrl-C
while the first one unwinds, so that ``finally`` blocks (temporary folders, the progress
display) run to their end. ``main`` then prints one line and returns 130.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import time
import weakref
from types import FrameType
from typing import Any

__all__ = ["EXIT_INTERRUPTED", "Interrupts"]

#: Exit status after Ctrl-C: 128 + SIGINT, as a shell reports it.
EXIT_INTERRUPTED = 128 + signal.SIGINT

#: A Ctrl-C this long after the first one raises again (the first was caught and dropped by
#: some library); earlier ones are ignored while the first unwinds.
REARM_S = 3.0

_FINALIZE_CODE = weakref.finalize.__call__.__code__


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``weakref.finalize`` callback, a ``__del__`` method or
    the unraisable hook (an exception raised in any of them is swallowed)."""
    while frame is not None:
        code = frame.f_code
        if code in _SWALLOWING_CODES or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class Interrupts:
    """The command line's SIGINT handler (install it in the main thread).

    Attributes:
        received: a SIGINT arrived since `install`.
    """

    def __init__(self) -> None:
        self.received = False
        self._raised_at: float | None = None
        self._previous_handler: Any = None
        self._previous_hook: Any = None

    def install(self) -> None:
        """Handle SIGINT here until `restore` (no-op outside the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous_handler = signal.signal(signal.SIGINT, self._handle)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable

    def restore(self) -> None:
        """Put back the handler and the unraisable hook found by `install`."""
        if self._previous_hook is None:
            return
        signal.signal(signal.SIGINT, self._previous_handler)
        sys.unraisablehook = self._previous_hook
        self._previous_hook = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        if self._raised_at is not None and time.monotonic() - self._raised_at < REARM_S:
            return  # the first one is unwinding: let its cleanup finish
        if _in_finalizer(frame):
            self._again()  # raised here it would be swallowed
            return
        self._raised_at = time.monotonic()
        raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._raised_at = None  # swallowed where Python cannot raise: raise it again
            self._again()
            return
        self._previous_hook(unraisable)

    @staticmethod
    def _again() -> None:
        """Deliver SIGINT to the main thread again in a moment (from a helper thread)."""
        timer = threading.Timer(0.005, _thread.interrupt_main)
        timer.daemon = True
        timer.start()  # it may fire before this returns: `_handle` then sees the hook's frame


#: Code whose frames swallow what is raised in them: ``weakref.finalize`` callbacks and the
#: unraisable hook (a SIGINT handled while it starts the timer would be lost there).
_SWALLOWING_CODES = frozenset({_FINALIZE_CODE, Interrupts._unraisable.__code__})
