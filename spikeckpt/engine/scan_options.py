"""What every part of one ``scan`` run reads: its keywords (`ScanOptions`) and its inputs
over time (`Timed`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from spikeckpt.engine.readout import Readout
from spikeckpt.engine.tree import TreeDef

__all__ = ["ScanOptions", "Timed"]

#: the input leaves (time first), their structure and ``T``
Timed = tuple[list[Tensor], TreeDef, int]


@dataclass(frozen=True)
class ScanOptions:
    """How a run goes: scan's keywords that every part of the run reads."""

    plan: Any
    storage: str
    readout: Readout
    budget: int | str | None
    directory: str | os.PathLike | None
    pack_tape: bool
    #: step 0 ran apart (`spikeckpt.engine.first_step`): the run has ``T - 1`` steps of
    #: the user's ``T``, and messages count the user's
    apart: int = 0
