"""What memory a training run has: free device memory and what the model already holds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spikeckpt.storage.spiketrain import SpikeTrain
from spikeckpt.units import available_host_bytes


def free_device_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes: CUDA ``mem_get_info``, else the host's available RAM."""
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return available_host_bytes()


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def model_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """Bytes the model holds during training: parameters, buffers, their gradients and the
    optimizer state (gradients are counted as one more copy of every trainable parameter,
    since they exist after the first backward)."""
    params = list(module.parameters())
    total = _tensor_bytes(params) + _tensor_bytes(module.buffers())
    total += _tensor_bytes(p for p in params if p.requires_grad)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            # a parameter's state is made at its first step (a group added later, unfrozen
            # layers' among them, has none yet): estimated until then
            copies = _expected_state_copies(optimizer, group)
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and not _grows(optimizer):
                    total += _tensor_bytes(batch_tensors(list(state.values())))
                else:
                    total += copies * _tensor_bytes([p])
    return total


def _expected_state_copies(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """Copies of a parameter group's parameters that ``optimizer`` keeps once it has stepped
    (torch's optimizers: Adam-like 2, 3 with ``amsgrad``; Adadelta and Rprop 2; RMSprop 1, one
    more with ``momentum`` and one more ``centered``; SGD 1 with momentum, else 0; others 1)."""
    name = type(optimizer).__name__.lower()
    if "adam" in name or "lamb" in name:
        return 3 if group.get("amsgrad") else 2
    if name in ("adadelta", "rprop"):
        return 2
    if name == "rmsprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if name == "sgd":
        return 1 if group.get("momentum", 0) else 0
    if name == "lbfgs":  # two per step of history (old_dirs, old_stps), d, prev_flat_grad,
        return 3 + 2 * int(group.get("history_size", 100))  # and one for 2h + 1 scalars
    return 1


def _grows(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer whose state grows over its first steps (LBFGS's history): counted at its
    full size from the start."""
    return type(optimizer).__name__.lower() == "lbfgs"


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor ``optimizer``'s state holds, those in lists too (LBFGS's history)."""
    return [t for state in optimizer.state.values() for t in batch_tensors(list(state.values()))]


def step_resident(
    module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (), batch: Any = None
) -> list[torch.Tensor]:
    """The tensors a training step holds from before it starts: parameters, buffers, their
    gradients, the optimizer state and the tensors of ``batch`` (a packed
    [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain] counts with its packed tensors). For
    ``MemoryMeter.track``, which keeps only those on the measured device: a batch left on the
    host of a GPU run is not counted."""
    params = list(module.parameters())
    tensors = [*params, *module.buffers(), *(p.grad for p in params if p.grad is not None)]
    for optimizer in optimizers:
        tensors += optimizer_state_tensors(optimizer)
    return tensors + batch_tensors(batch)


def callback_copies(
    callbacks: Iterable[Any], module: nn.Module, device: torch.device
) -> list[torch.Tensor]:
    """The tensors on ``device`` of the models other callbacks keep beside ``module``: an EMA
    or SWA copy (``torch.optim.swa_utils.AveragedModel``; Lightning's
    ``StochasticWeightAveraging``) held as a callback's attribute; their parameters and
    buffers, less any that ``module`` holds itself (bytes the step's device holds throughout,
    which the budget counts with the model's)."""
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    found: list[torch.Tensor] = []
    for callback in callbacks:
        for value in vars(callback).values():
            if not isinstance(value, nn.Module) or value is module:
                continue
            for t in (*value.parameters(), *value.buffers()):
                if t.device == device and t.untyped_storage().data_ptr() not in own:
                    found.append(t)
    return found


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (each storage once)."""
    return _tensor_bytes(tensors)


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """Every tensor in a batch (nested tuples, lists and dicts; a packed train's tensors)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, SpikeTrain):
        return batch.tensors()
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in batch_tensors(item)]
    if isinstance(batch, dict):
        return [t for item in batch.values() for t in batch_tensors(item)]
    return []
