"""The stack granularity's model step compiled with ``torch.compile``: one switch, one fallback.

The stack granularity calls the model's step once per time step. On a small network (three
layers of 8 neurons, batch 1) a step is a few dozen tiny operations and the time is all per-op
dispatch; compiled (inductor: C++ on the CPU, Triton on CUDA) the step's elementwise work
becomes a few fused kernels and autograd runs one compiled backward per step. Measured on the
development machine (one thread; 3 x Linear(8, 8) + snnTorch Leaky, batch 1, T = 2000):
`BPTT()` took 0.35x its eager time after 3.5 s of compiling.

Exactness. Inductor rewrites small matrix products on the CPU (a batch-1 ``addmm`` with at
most 16 features, matrix-vector and ``K = 1`` products) into elementwise products and sums,
decomposes normalizations into its own reductions, and draws dropout masks with ``rand`` where
ATen draws ``bernoulli_``. The backend here (`exact_backend`) keeps those operations as the
same ATen calls as eagerly and takes random numbers from ATen's generator
(``fallback_random``), so Dropout draws the masks it draws eagerly and the engine's replay of
the random state holds; the elementwise work keeps its operations and order (inductor
contracts no multiply-add on the CPU by default). What remains different is rounding where
inductor sums by itself (a gradient summed over the batch or the neurons: a bias, a learnable
scalar threshold, around a normalization) or computes a transcendental function in its own
vector code: gradients then agree to float32 round-off (the sums of a few terms measured
bitwise here). Tests compare the compiled step with the eager
one on the plans: outputs bitwise, gradients bitwise without learnable neuron parameters.
The first step runs eagerly (adapters check their fast steps once; see `CompiledStep`).

``compile=True`` compiles the step (any device with a compiler); ``"auto"`` compiles it once a
shape's eager calls have paid for the compile and keeps it where faster
(`spikeckpt.engine.auto_compile`); False keeps it eager. Under a ``TorchDispatchMode`` (``MemoryMeter``'s tensor mode, the
planner's probes) dynamo runs the step eagerly: the same values. Any failure to compile runs
the step eagerly from then on, with one line.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spikeckpt.engine.compiled import (
    compiler_missing,
    eager_numerics,
    note_eager,
    own_code,
    under_dispatch_mode,
)

__all__ = ["CompiledStep", "compiled_step", "exact_backend", "hooks_key"]

#: ATen operations kept as ATen calls rather than decomposed: the matrix products (inductor
#: rewrites small ones into elementwise products and sums), the normalizations (their
#: decompositions reduce in another order) and the random draws (a decomposed dropout draws
#: ``rand`` where ATen draws ``bernoulli_``: other masks from the same generator state)
_KEPT = (
    *("addmm", "mm", "bmm", "mv", "addmv", "dot", "baddbmm", "addbmm"),
    *("native_batch_norm", "native_batch_norm_backward", "batch_norm_backward"),
    *("_native_batch_norm_legit", "_native_batch_norm_legit_functional"),
    *("_native_batch_norm_legit_no_training", "_batch_norm_with_update"),
    *("_batch_norm_with_update_functional", "_batch_norm_no_update"),
    *("_batch_norm_impl_index_backward", "native_layer_norm", "native_layer_norm_backward"),
    *("native_group_norm", "native_group_norm_backward", "layer_norm", "group_norm"),
    *("instance_norm", "native_dropout", "native_dropout_backward", "bernoulli", "bernoulli_"),
    *("rand_like", "randn_like", "randint_like", "normal", "normal_", "normal_functional"),
)


@functools.cache
def exact_backend() -> Callable[..., Any] | str:
    """Inductor without its matrix-product decompositions and with ATen's random numbers, or
    plain ``"inductor"`` where this torch's inductor does not take those arguments."""
    try:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
    except ImportError:  # pragma: no cover - a torch without these internals
        return "inductor"
    kept = {getattr(torch.ops.aten, name) for name in _KEPT}
    table = {
        op: fn
        for op, fn in select_decomp_table().items()
        if getattr(op, "overloadpacket", None) not in kept
    }

    def inner(*args: Any, **kwargs: Any) -> Any:
        with _outside_ci():
            return compile_fx_inner(*args, **kwargs)

    def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        return compile_fx(
            graph,
            inputs,
            inner_compile=inner,
            config_patches={"fallback_random": True, **eager_numerics()},
            decompositions=table,
        )

    return backend


_CI_LOCK = threading.RLock()  # a compile may start another inside it


@contextlib.contextmanager
def _outside_ci() -> Iterator[None]:
    """Inductor's compile with the environment variable ``CI`` unset.

    The operations `exact_backend` keeps (dropout's and batch norm's backward, ...) reach
    inductor's lowering without a lowering of their own, and inductor calls them as ATen
    fallbacks; with ``CI`` set (GitHub Actions and most CI services set it) inductor instead
    asserts that an operation with a decomposition is never a fallback, a check for inductor's
    own development, and the compile fails. Both the forward and the (lazily compiled)
    backward pass through here."""
    with _CI_LOCK:
        saved = os.environ.pop("CI", None)
        try:
            yield
        finally:
            if saved is not None:
                os.environ["CI"] = saved


def _nothing() -> None:
    """What a copied or unpickled `CompiledStep` becomes: its model compiles its own again."""
    return None


class CompiledStep:
    """``step(state, x_t) -> (state, y_t)`` run compiled, falling back to ``step`` itself
    (for good, with one line) where compiling or running compiled fails.

    Each input shape, dtype and grad mode compiles a copy of its own (`own_code`): dynamo
    keeps at most ``recompile_limit`` (8) entries per code object, and each shape takes two
    (the state without a gradient, at the first call, and with one), so one copy for all
    ran a model's fifth batch size eagerly, 2x slower, while ``ran_compiled`` said True.

    Attributes:
        ran_compiled: whether the last call went through the compiled function without error.
    """

    def __init__(self, step: Callable[[Any, Any], Any]) -> None:
        self.step = step
        #: the compiled copies, by the input step's shape, dtype, device and the grad mode
        self.compiled: dict[tuple[Any, ...], Callable[[Any, Any], Any]] = {}
        self.failed = False
        self.warm = False
        self.ran_compiled = False

    def __reduce__(self) -> tuple[Any, ...]:
        """Copies (``copy.deepcopy`` of the wrapped model, pickling) hold None: the compiled
        function is bound to the original model's step and its tensors."""
        return (_nothing, ())

    def __call__(self, state: Any, x_t: Any) -> Any:
        if not self.warm:  # the first step eagerly: one-time checks (an adapter verifying
            self.warm = True  # its fast step) would break the compiled graph
            return self.step(state, x_t)
        if not self.failed and not under_dispatch_mode():  # see spikeckpt.engine.compiled
            try:
                out = self._compiled_for(x_t)(state, x_t)
            except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
                self.failed = True
                note_eager(f"torch.compile failed on the model's step ({type(error).__name__})")
            else:
                self.ran_compiled = True
                return out
        self.ran_compiled = False
        return self.step(state, x_t)

    def _compiled_for(self, x_t: Any) -> Callable[[Any, Any], Any]:
        """The compiled copy for ``x_t``'s shape, dtype and device and the grad mode."""
        key = (
            tuple(getattr(x_t, "shape", ())),
            getattr(x_t, "dtype", None),
            str(getattr(x_t, "device", "")),
            torch.is_grad_enabled(),
        )
        if key not in self.compiled:
            self.compiled[key] = torch.compile(
                own_code(self.step), dynamic=False, backend=exact_backend()
            )
        return self.compiled[key]


def hooks_key(model: torch.nn.Module) -> tuple[Any, ...]:
    """The module hooks a step compiled now would be traced with: the handles' ids of every
    module's forward, forward-pre, backward and backward-pre hooks, and of the global ones.

    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``
    is True by default): a step compiled before a hook was registered ran without it, silently
    (a forward hook scaling a layer's output, a full backward hook scaling its gradient: the
    loop's gradients off by 23 on a small net), and one compiled with a hook kept running it
    after its removal. The wrapper compiles the step afresh when this key changes."""
    from torch.nn.modules import module as torch_module

    global_hooks = (
        torch_module._global_forward_hooks,
        torch_module._global_forward_pre_hooks,
        torch_module._global_backward_hooks,
        torch_module._global_backward_pre_hooks,
    )
    own = tuple(
        (id(m), tuple(m._forward_hooks), tuple(m._forward_pre_hooks))
        + (tuple(m._backward_hooks), tuple(m._backward_pre_hooks))
        for m in model.modules()
    )
    return (tuple(tuple(hooks) for hooks in global_hooks), own)


def compiled_step(step: Callable[[Any, Any], Any], device: torch.device) -> CompiledStep | None:
    """A `CompiledStep` of ``step``, or None (with one line) where no compiler runs here."""
    missing = compiler_missing(device.type)
    if missing is not None:
        note_eager(missing)
        return None
    return CompiledStep(step)
