"""spikeckpt: train spiking and sparse recurrent networks on long sequences with exact gradients.

``import spikeckpt`` needs torch alone, and ``import spikeckpt.plans`` imports no torch at all:
the torch-based names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from spikeckpt import plans
from spikeckpt.errors import (
    BudgetTooSmall,
    ConfigError,
    ConfigTypeError,
    MissingDependencyError,
    NotBinaryError,
    ScheduleError,
    SlowPlanWarning,
    SpikeckptError,
    StorageError,
    UnlistedParamsError,
    UnsupportedLayerError,
    UsageError,
)
from spikeckpt.units import format_bytes, parse_bytes

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "scan": "spikeckpt.engine.scan",
    "ScanStats": "spikeckpt.engine.scan",
    "ScanResult": "spikeckpt.engine.scan",
    "MemoryMeter": "spikeckpt.engine.meter",
    "pack": "spikeckpt.storage.codecs",
    "unpack": "spikeckpt.storage.codecs",
    "SpikeTrain": "spikeckpt.storage.spiketrain",
    "wrap": "spikeckpt.wrapping",
    "unwrap": "spikeckpt.wrapping",
    "CheckpointedSequence": "spikeckpt.wrapping",
    "DataNotFoundError": "spikeckpt.data.errors",
}

__all__ = [
    "BudgetTooSmall",
    "CheckpointedSequence",
    "ConfigError",
    "ConfigTypeError",
    "DataNotFoundError",
    "MemoryMeter",
    "MissingDependencyError",
    "NotBinaryError",
    "ScanResult",
    "ScanStats",
    "ScheduleError",
    "SlowPlanWarning",
    "SpikeTrain",
    "SpikeckptError",
    "StorageError",
    "UnlistedParamsError",
    "UnsupportedLayerError",
    "UsageError",
    "format_bytes",
    "pack",
    "parse_bytes",
    "plans",
    "scan",
    "unpack",
    "unwrap",
    "wrap",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'spikeckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
