"""Adapters: turn a layer into an initial-state builder and a pure step function.

See :mod:`spikeckpt.adapters.base` for the protocol. snnTorch and Norse adapters live in
``adapters/snntorch.py`` and ``adapters/norse.py`` and are imported only when a layer of that
framework is found, so ``import spikeckpt.adapters`` needs torch alone.
"""

from spikeckpt.adapters.base import (
    LayerAdapter,
    Registration,
    adapter_for,
    register_adapter,
    registered_adapters,
    supported_summary,
    unregister_adapter,
)
from spikeckpt.adapters.generic import (
    RNNCellAdapter,
    StatefulAdapter,
    StatelessAdapter,
)
from spikeckpt.adapters.sequential import StackAdapter

__all__ = [
    "LayerAdapter",
    "RNNCellAdapter",
    "Registration",
    "StackAdapter",
    "StatefulAdapter",
    "StatelessAdapter",
    "adapter_for",
    "register_adapter",
    "registered_adapters",
    "supported_summary",
    "unregister_adapter",
]
