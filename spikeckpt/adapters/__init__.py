"""Adapters: turn a layer into an initial-state builder and a pure step function.

See `spikeckpt.adapters.protocol` for the protocol and `spikeckpt.adapters.registry`
for the lookup. snnTorch and Norse adapters live in ``adapters/snntorch.py`` and
``adapters/norse.py`` and are imported only when a layer of that framework is found, so
``import spikeckpt.adapters`` needs torch alone.
"""

from spikeckpt.adapters.generic import (
    CustomLayerAdapter,
    HiddenStateAdapter,
    RNNCellAdapter,
    StatefulAdapter,
    StatelessAdapter,
)
from spikeckpt.adapters.protocol import LayerAdapter
from spikeckpt.adapters.registry import (
    Registration,
    adapter_for,
    register_adapter,
    registered_adapters,
    supported_summary,
    unregister_adapter,
)
from spikeckpt.adapters.sequential import StackAdapter

__all__ = [
    "CustomLayerAdapter",
    "HiddenStateAdapter",
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
