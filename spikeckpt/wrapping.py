"""``spikeckpt.wrap`` (this module is ``spikeckpt.wrapping``): run a snnTorch / Norse / torch
model's time loop through spikeckpt's engine.

>>> import torch
>>> from spikeckpt.models import LIFStack
>>> net = LIFStack((20, 32, 5)).as_sequential()   # nn.Sequential of layers and neurons
>>> seq = wrap(net, plan="auto", budget="2GiB")
>>> x = torch.rand(100, 8, 20).lt(0.1).float()     # (T, B, inputs) spikes
>>> seq(x).shape                                   # (T, B, outputs)
torch.Size([100, 8, 5])
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from spikeckpt.adapters.layered import draws_apart, layer_blocks, with_current_modes
from spikeckpt.adapters.protocol import LayerAdapter, State
from spikeckpt.adapters.registry import adapter_for, model_key, norse_sequence_dropouts
from spikeckpt.adapters.sequential import Block, check_given_state, split_blocks
from spikeckpt.engine.auto_compile import AutoCompiledStep, input_key
from spikeckpt.engine.compiled import Compile
from spikeckpt.engine.compiled_step import CompiledStep, compiled_step, hooks_key
from spikeckpt.engine.function import refuse_func_transforms
from spikeckpt.engine.grad import not_behind
from spikeckpt.engine.hook_guard import hook_guard
from spikeckpt.engine.inputs import as_input, is_packed, step_of
from spikeckpt.engine.layerwise import LayerBlock, layerwise_scan
from spikeckpt.engine.outer_compile import eager_under_compile
from spikeckpt.engine.phase import refuse_power_iteration, uncached_parametrizations
from spikeckpt.engine.scan import Storage, scan
from spikeckpt.engine.stats import ScanStats
from spikeckpt.engine.step import no_own_draws, readout_params
from spikeckpt.errors import (
    ConfigError,
    ConfigTypeError,
    UnlistedParamsError,
    UnsupportedLayerError,
    warn_in_callers_code,
)
from spikeckpt.planning.decide import BudgetPlanner, Decision, Planner, timed_decision
from spikeckpt.storage.tiers import check_storage
from spikeckpt.units import format_bytes, parse_bytes
from spikeckpt.wrap_options import (
    check_compile,
    check_granularity,
    check_input,
    check_model,
    check_options,
    check_params,
    check_plan,
    refuse_integer_input,
    refuse_unbatched,
)
from spikeckpt.wrapped.call_tensors import (
    ForwardTensors,
    param_ids,
    refuse_swapped,
    swapped_params,
    tensor_slots,
)
from spikeckpt.wrapped.state_keys import (
    Remade,
    add_prefix,
    has_membrane,
    no_membrane,
    strip_missing,
    strip_prefix,
)
from spikeckpt.wrapped.unlisted import unlisted_error

__all__ = ["CheckpointedSequence", "unwrap", "wrap"]

Output = Literal["spikes", "mem", "both"]
_OUTPUTS = ("spikes", "mem", "both")
Granularity = Literal["stack", "layer", "auto"]


class CheckpointedSequence(Remade):
    """A model whose time loop runs through spikeckpt's engine (checkpointed memory, exact
    gradients). Build it with [`wrap`][spikeckpt.wrapping.wrap].

    ``forward(x, *, state=None, return_state=False)``: ``x`` is ``(T, B, ...)`` (``(B, T, ...)``
    with ``batch_first``), or a packed spike train ``(T, B, ...)`` (see [`forward`][spikeckpt.wrapping.CheckpointedSequence.forward]);
    returns the last layer's output per step, ``(T, B, ...)`` (or the reduced value with a
    ``readout``), and with ``return_state`` also the final state.

    The module is plumbing: at each forward it asks its planner
    ([`Planner`][spikeckpt.planning.decide.Planner] from its own ``plan``, ``budget``, ``granularity``
    and ``chunk``, or the one set in ``planner``, e.g. by
    [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget]) for a
    [`Decision`][spikeckpt.planning.decide.Decision] and runs it: [`spikeckpt.scan`][spikeckpt.engine.scan.scan] (stack) or
    [`layerwise_scan`][spikeckpt.engine.layerwise.layerwise_scan] (layer-wise).

    Attributes:
        module: the original model, registered as a submodule; ``state_dict()`` has exactly the
            original model's keys, so checkpoints load into either.
        adapter: the `LayerAdapter` that steps it.
        planner: a planner that overrides the model's own (``decide(model, x, state)``), or
            None.
        last_decision: how the last forward ran (granularity, plan, chunk).
        last_stats: the last run's [`ScanStats`][spikeckpt.engine.stats.ScanStats] (plan, forward steps, bytes
            written off the device, peaks; a layer-wise run's has per-block spike figures).
    """

    def __init__(
        self,
        module: nn.Module,
        adapter: LayerAdapter,
        *,
        plan: Any = "auto",
        storage: str = "host",
        readout: Any = None,
        batch_first: bool = False,
        budget: int | str | None = None,
        output: Output = "spikes",
        as_call: bool = False,
        granularity: Granularity = "stack",
        chunk: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        pack_tape: bool = False,
        params: Sequence[Tensor] | None = None,
        fuse: bool = True,
        compile: Compile = "auto",
        exact: bool = False,
    ) -> None:
        super().__init__()
        self.fuse = fuse
        self.exact = exact
        self.compile_mode = check_compile(compile)
        #: the stack granularity's compiled step (``compile=True`` or "auto"; made at first use)
        self._compiled_step: CompiledStep | AutoCompiledStep | None = None
        self._hooks_key = hooks_key(module)  # the hooks it was compiled with (`hooks_key`)
        self.module = module
        self.adapter = adapter
        self.plan = plan
        self.storage = storage
        self.readout = readout
        self.batch_first = batch_first
        self.budget = budget
        self.output = output
        #: each step's output is what the model's own per-step call returns (``wrap`` with
        #: ``output=None`` for a net whose last snnTorch neuron has ``output=True``: ``(spk,
        #: mem)``, ``(spk, syn, mem)``, ...); ``output`` is then ``"both"``
        self.as_call = as_call
        self.directory = directory
        self.pack_tape = pack_tape
        self.granularity = check_granularity(granularity)
        self.chunk = chunk
        #: tensors to differentiate besides the model's parameters (``wrap(..., params=...)``)
        self.extra_params: list[Tensor] = check_params(params)
        self.planner: Planner | BudgetPlanner | None = None
        self.last_stats: ScanStats | None = None
        self.last_decision: Decision | None = None
        self._own: tuple[tuple[Any, ...], Planner] | None = None
        self._blocks: list[Block] | None = None
        self._layer_blocks: list[LayerBlock] | None = None
        self._warned_draws = False  # Dropout in two blocks run layer-wise: warned once
        self._blocks_exact = exact  # the ``exact`` the layer-wise blocks were made with
        #: the model's layers and options the adapter was made from (`_refresh`)
        self._key: tuple[Any, ...] = model_key(module)
        self._param_ids = param_ids(module)
        if granularity == "layer":
            self.layer_blocks(True)  # refuse a model that has no blocks now, not at forward
        self._register_state_dict_hook(strip_prefix)
        self.register_load_state_dict_pre_hook(add_prefix)
        self.register_load_state_dict_post_hook(strip_missing)

    # -- what the engine and the planners use ------------------------------------------------
    def step(self, state: State, x_t: Tensor) -> tuple[State, Any]:
        """One time step of the whole model: ``(state, x_t (B, ...)) -> (state, y_t)``."""
        state, y = self.adapter.step(state, x_t)
        if self.as_call and self.output == "both":
            extra = self.adapter.call_outputs(state)
            return state, (y if extra is None else (y, *extra))
        if self.output == "spikes":
            return state, y
        mem = self.adapter.membrane(state)
        return state, (mem if self.output == "mem" else (y, mem))

    def probe_signature(self) -> tuple[Any, ...]:
        """What this model's step holds depends on beside its code and tensor shapes: the
        layers and their options (`model_key`) and what each step returns. The probe and
        plan caches key on it (a spikes-only model's cached probe was used for a same-shaped
        model returning ``(spk, mem)``: one output and its gradient uncounted)."""
        return (self._key, self.output, self.as_call)

    def params_swapped(self) -> bool:
        """Whether the model holds parameters requiring grad other than those it was wrapped
        (or last changed) with: ``torch.func.functional_call`` swaps them in for one call.
        ``granularity="auto"`` then runs the stack, which is exact under the swap."""
        return bool(swapped_params(self.module, self._param_ids))

    def initial_state(self, x_t: Tensor) -> State:
        """The state at t=0 for one step's input ``x_t (B, ...)`` (zeros, or Norse's own)."""
        return self.adapter.init_state(x_t)

    def parameters_for_scan(self) -> list[Tensor]:
        """The tensors the engine differentiates: the model's parameters, the tensors requiring
        grad that its layers hold outside them (Norse's ``p``, tensor attributes such as a
        neuron's ``self.beta = torch.full(..., requires_grad=True)``), those a callable
        readout reaches (its own readout matrix or head) and ``params``."""
        seen: dict[int, Tensor] = {}
        own = readout_params(self.readout)
        for t in [
            *self.module.parameters(),
            *self.adapter.extra_params(),
            *self.extra_params,
            *own,
        ]:
            seen.setdefault(id(t), t)
        return not_behind(list(seen.values()))

    def device_for(self, x: Any) -> Any:
        """The device ``x``'s steps run on: a dense ``x``'s own; a packed train's steps are
        unpacked on the model's device (its first parameter's or buffer's; else where the
        train is)."""
        if not is_packed(x):
            return x.device
        for t in (*self.module.parameters(), *self.module.buffers()):
            return t.device
        return x.device

    def cleanup(self) -> None:
        """Drop the state and graphs the framework left on the model's modules."""
        self.adapter.cleanup()

    def layer_blocks(self, required: bool) -> list[LayerBlock] | None:
        """The model's feed-forward blocks for the layer-wise granularity; ``None`` when it has
        none (``UnsupportedLayerError`` saying why when ``required``)."""
        self._refresh()
        if self._layer_blocks is not None and self._blocks_exact != self.exact:
            self._blocks = self._layer_blocks = None  # ``seq.exact`` set since they were made
        if self._blocks is None:
            try:
                self._blocks = split_blocks(self.adapter)
            except UnsupportedLayerError:
                if required:
                    raise
                return None
            self._layer_blocks = layer_blocks(self._blocks, exact=self.exact)
            self._blocks_exact = self.exact
        assert self._layer_blocks is not None
        # a Dropout's mode may have changed since (.train() / .eval()): read it now
        self._layer_blocks = with_current_modes(self._layer_blocks, self._blocks)
        return self._layer_blocks

    def block_states(self, state: State) -> list[State]:
        """Each block's state: ``state[neuron index]`` for a stack, the whole state for a
        single neuron (its block has no index)."""
        assert self._blocks is not None
        if self._blocks[0].index is None:
            return [state]
        return [state[b.index] for b in self._blocks]

    @property
    def _auto_chunks(self) -> dict[tuple[int, int], int | None]:
        """``granularity="auto"``: per ``(T, B)``, the layer-wise chunk chosen (None: stack)."""
        own = self._own[1].decisions if self._own is not None else {}
        return {key: d.chunk if d.granularity == "layer" else None for key, d in own.items()}

    def _own_planner(self) -> Planner:
        """The planner of the model's own settings (rebuilt when they change)."""
        key = (self.plan, self.budget, self.granularity, self.chunk)
        if self._own is None or any(a is not b for a, b in zip(self._own[0], key, strict=True)):
            self._own = (key, Planner(self.plan, self.budget, self.granularity, self.chunk))
        return self._own[1]

    # -- forward -----------------------------------------------------------------------------
    @eager_under_compile
    def forward(
        self,
        x: Tensor,
        *legacy: Any,
        state: State | None = None,
        return_state: bool = False,
    ) -> Any:
        """Run ``x`` ``(T, B, ...)`` (or ``(B, T, ...)``) through the model over time.

        Args:
            x: the input sequence: a tensor, or a packed spike train (a
                [`SpikeTrain`][spikeckpt.storage.spiketrain.SpikeTrain], or a ``torch.sparse_coo`` tensor with
                0/1 values, packed with [`as_spike_train`][spikeckpt.storage.spiketrain.as_spike_train]). A packed
                train stays packed where it is (on the host, or on the device at 1 bit per
                element) and is unpacked on the model's device one step (stack) or one chunk
                (layer-wise) at a time; it gets no gradient. Packed trains are always time
                first: with ``batch_first=True`` a packed train is refused
                ([`ConfigError`][spikeckpt.errors.ConfigError]); the outputs of a packed train
                are time first too.
            state: initial state (same structure as the returned one; for stacks a tuple or
                list with ``None`` for layers that start fresh). Default: zeros / Norse's own.
            return_state: also return the final state. Models whose own call returns
                ``(output, state)`` (Norse; ``adapter.returns_state``) always do.
            legacy: deprecated positional forms, ``seq(x, state)`` and ``seq(x, True)``
                (a ``DeprecationWarning``; pass ``state=`` and ``return_state=`` by keyword).
        """
        refuse_func_transforms()
        if legacy:
            state, return_state = _legacy_call(legacy, state, return_state)
        if self.compile_mode is not False:  # dynamo guards no hooks: compile afresh
            key = hooks_key(self.module)
            if key != getattr(self, "_hooks_key", None):
                self._compiled_step, self._hooks_key = None, key
        with uncached_parametrizations(), hook_guard(self.module, self.compile_mode is not True):
            return self._forward(x, state, return_state)

    def _forward(self, x: Any, state: State | None, return_state: bool) -> Any:
        return_state = return_state or self.adapter.returns_state
        x = as_input(check_input(x))
        packed = is_packed(x)
        if len(x.shape) < 2:
            raise ConfigError(f"x must have a time and a batch axis, got shape {tuple(x.shape)}")
        if self.batch_first and packed:
            raise ConfigError(
                f"batch_first=True takes a dense (B, T, ...) tensor; a packed spike train is "
                f"always time first, (T, B, ...) = {tuple(x.shape)}: wrap with "
                "batch_first=False for packed trains (pack the train time first)"
            )
        if self.batch_first:
            x = x.transpose(0, 1)
        if x.shape[0] == 0:
            axis = "second (batch_first=True)" if self.batch_first else "first"
            raise ConfigError(
                f"x holds T=0 time steps (shape {tuple(x.shape)}, time on the {axis} axis); "
                "pass at least one step"
            )
        refuse_unbatched(self.module, x, self.batch_first)
        refuse_integer_input(self.module, x)
        self._refresh()
        self.adapter.check()
        x_0 = step_of(x, 0, self.device_for(x))
        if state is None:
            state = self.adapter.init_state(x_0)
        else:
            state = self.adapter.coerce_state(state, x_0)
            check_given_state(self.adapter, state, x_0)
        del x_0
        planner = self.planner if self.planner is not None else self._own_planner()
        decision, planning = timed_decision(planner, self, x, state)
        self.last_decision = decision
        try:
            if decision.granularity == "layer":
                ys, final, self.last_stats = self._run_layerwise(x, state, decision)
            else:
                step, started = self._stack_step(x), time.perf_counter()
                out = scan(
                    ForwardTensors(step, tensor_slots(self.module)),
                    x,
                    state,
                    plan=decision.plan,
                    storage=cast(Storage, self.storage),  # one of them: check_storage
                    readout=self.readout,
                    params=self.parameters_for_scan(),
                    budget=decision.budget,
                    directory=self._directory(),
                    pack_tape=self.pack_tape,
                )
                (ys, final), self.last_stats = out, out.stats
                self.last_stats.step_compiled = isinstance(step, CompiledStep) and step.ran_compiled
                if isinstance(self._compiled_step, AutoCompiledStep):  # planning left out
                    took = time.perf_counter() - started - out.stats.planning_seconds
                    self._compiled_step.ran(input_key(x), step, took)
        except UnlistedParamsError as err:
            x_0 = step_of(x, 0, self.device_for(x))
            params = self.parameters_for_scan()
            raise unlisted_error(self.adapter, err, state, x_0, params) from None
        finally:
            self.adapter.cleanup()
        self.last_stats.planning_seconds += planning  # beside what scan spent planning
        if decision.choice is not None:  # planned for a budget: the step as planned
            self.last_stats.planned = decision.choice.step
            self.last_stats.note = decision.choice.note
        if self.batch_first and self.readout is None:
            ys = _tree_map(lambda y: y.transpose(0, 1), ys)
        if self.follows_call:  # output=None: what the model's call returns
            ys = self.adapter.call_result(ys, final)
        return (ys, self.adapter.user_state(final)) if return_state else ys

    def _stack_step(self, x: Any) -> Any:
        """`step`, compiled where ``compile=True`` or ``"auto"`` finds it pays (`auto_compile`)."""
        if self.compile_mode is False:
            return self.step
        if self.compile_mode == "auto":
            if not isinstance(self._compiled_step, AutoCompiledStep):
                self._compiled_step = AutoCompiledStep(self.step, self.device_for(x))
            return self._compiled_step.step_for(input_key(x), self.module)
        if not isinstance(self._compiled_step, CompiledStep):
            self._compiled_step = compiled_step(self.step, self.device_for(x))  # None: eager
        return self._compiled_step or self.step

    def _run_layerwise(self, x: Tensor, state: State, decision: Decision) -> Any:
        if callable(self.readout):
            raise ConfigError(
                "granularity='layer' supports the named readouts; a callable readout needs "
                "granularity='stack'"
            )
        blocks = self.layer_blocks(True)
        assert blocks is not None and self._blocks is not None
        refuse_swapped(self.module, blocks)
        auto = self.granularity == "auto"
        apart = None if self._warned_draws else draws_apart(self._blocks, self.module, auto)
        if apart is not None:
            warn_in_callers_code(apart)
            self._warned_draws = True  # once per wrapped model
        if torch.is_grad_enabled():
            refuse_power_iteration(list(self.module.modules()))
        states = self.block_states(state)
        spec = None
        if self.as_call and self.output == "both":
            # the top neuron's call outputs after the spikes, as extra outputs of the run
            blocks, spec = _call_blocks(blocks, self._blocks[-1].neuron, states[-1])
        way = "draw without generator=, or use granularity='stack' with plan=BPTT()"
        with no_own_draws(self.module, "granularity='layer'", way):  # chunks are recomputed
            out = layerwise_scan(
                blocks,
                x,
                states,
                chunk=decision.chunk,
                storage=self.storage,
                readout=self.readout,
                output=self.output,
                params=self.parameters_for_scan(),
                directory=self._directory(),
                fuse=self.fuse,
                compile=self.compile_mode,
            )
        (ys, finals), stats = out, out.stats
        if spec is not None:
            ys = (ys[0], *_pytree().tree_unflatten(list(ys[1:]), spec))
        if self._blocks[0].index is None:
            return ys, finals[0], stats
        final = list(state)  # a stack: put each block's state at its layer
        for b, s in zip(self._blocks, finals, strict=True):
            final[cast(int, b.index)] = s  # every block's index is set (the first's is)
        return ys, tuple(final), stats

    def _directory(self) -> str | os.PathLike[str] | None:
        """The disk tier's folder, only with the disk tier (``storage`` may have been changed
        since wrapping: `set_storage`)."""
        return self.directory if self.storage == "disk" else None

    def set_planner(self, planner: Planner | BudgetPlanner | None) -> None:
        """Decide every forward with ``planner`` from now on (None: the model's own ``plan``,
        ``budget``, ``granularity`` and ``chunk``); what
        [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] installs for a fit."""
        self.planner = planner

    def set_storage(self, storage: str) -> None:
        """Keep remote checkpoints (and layer-wise trains) in ``storage`` from the next
        forward on: ``"host"``, ``"disk"`` or ``"device"`` (what
        [`MemoryBudget`][spikeckpt.lightning.budget.MemoryBudget] ``(storage=...)`` calls)."""
        check_storage(storage, self.directory if storage == "disk" else None)
        self.storage = storage

    def extra_repr(self) -> str:
        text = (
            f"plan={self.plan!r}, storage={self.storage!r}, readout={self.readout!r}, "
            f"output={self.output!r}, batch_first={self.batch_first}, "
            f"granularity={self.granularity!r}"
        )
        stats = self.last_stats
        if stats is not None:
            text += f", last run: {stats.plan}"
            peak = stats.peak_bytes.get("device")
            if peak is not None and stats.granularity != "layer":
                text += f" (its checkpoints and tapes peaked at {format_bytes(peak)})"
            if stats.planned is not None:
                text += f", planned step {format_bytes(stats.planned.total)}"
        return text


def _pytree() -> Any:
    from spikeckpt.engine import tree

    return tree


def _call_blocks(
    blocks: list[LayerBlock], neuron: LayerAdapter, state: State
) -> tuple[list[LayerBlock], Any]:
    """``blocks`` with the top block's ``membrane`` giving the leaves of the neuron's
    ``call_outputs`` (the layer-wise run returns them after the spikes), and their structure.
    Where the call returns the membrane only (snnTorch ``Leaky(output=True)``: ``spk, mem``)
    the blocks are unchanged (a fused kernel emits the membrane); where it returns state
    leaves (``Synaptic``: ``spk, syn, mem``; ``Alpha``) a fused kernel that `emits_states`
    emits them (the block's ``emits``); else that block's neuron runs one step at a time."""
    import dataclasses

    tree = _pytree()
    leaves, spec = tree.tree_flatten(neuron.call_outputs(state))
    if len(leaves) == 1 and leaves[0] is blocks[-1].membrane(state):
        return blocks, spec

    def outputs(s: State) -> tuple[Tensor, ...]:
        return tuple(tree.tree_leaves(neuron.call_outputs(s)))

    own = tree.tree_leaves(state)
    index = {id(t): i for i, t in enumerate(own)}
    found = tuple(index.get(id(t), -1) for t in leaves)
    fused = blocks[-1].fused
    if fused is None or not fused.emits_states or -1 in found or len(index) < len(own):
        fused = None  # not the state's leaves (or one tensor twice): per step
    emits = None if fused is None else found
    top = dataclasses.replace(blocks[-1], membrane=outputs, fused=fused, emits=emits)
    return [*blocks[:-1], top], spec


def _legacy_call(legacy: tuple[Any, ...], state: Any, return_state: bool) -> tuple[Any, bool]:
    """``(state, return_state)`` from the deprecated positional forms ``seq(x, state)``,
    ``seq(x, True)`` and ``seq(x, True, state)``."""
    warnings.warn(
        "seq(x, state) and seq(x, return_state) are deprecated: pass them by keyword, "
        "seq(x, state=state, return_state=True)",
        DeprecationWarning,
        stacklevel=4,
    )
    if len(legacy) > 2:
        raise ConfigTypeError(f"forward takes x and keywords; got {len(legacy) + 1} positionals")
    first = legacy[0]
    if isinstance(first, bool):  # the old order: forward(x, return_state, state)
        return (legacy[1] if len(legacy) == 2 else state), first
    return first, True  # a Norse-style call: seq(x, state)


def _tree_map(fn: Callable[[Tensor], Tensor], tree: Any) -> Any:
    from spikeckpt.engine.tree import tree_map

    return tree_map(fn, tree)


def wrap(
    model: nn.Module,
    plan: Any = "auto",
    storage: str = "host",
    readout: Any = None,
    batch_first: bool = False,
    budget: int | str | None = None,
    *,
    output: Output | None = None,
    granularity: Granularity = "stack",
    chunk: int | None = None,
    directory: str | os.PathLike[str] | None = None,
    pack_tape: bool = False,
    params: Sequence[Tensor] | None = None,
    fuse: bool = True,
    compile: Compile = "auto",
    exact: bool = False,
) -> CheckpointedSequence:
    """Wrap ``model`` so its time loop runs through [`spikeckpt.scan`][spikeckpt.engine.scan.scan].

    Args:
        model: an ``nn.Sequential`` of layers and neurons (snnTorch neurons, Norse cells),
            a Norse ``SequentialState``, a single neuron / cell / Norse sequence module, or any
            module with ``forward(x, state) -> (y, state)``.
        plan: a plan (``spikeckpt.plans.Revolve(8)``, ...), a ``Schedule`` or ``"auto"``
            (``plans.choose`` for ``budget``; without a budget: 90% of the CUDA memory free
            at the first call, or ``Uniform()`` on the CPU).
        storage: where remote checkpoints go: ``"host"``, ``"disk"`` or ``"device"``.
        readout: ``None`` (outputs ``(T, B, ...)``), ``"sum"``, ``"mean"``, ``"last"``,
            ``"max"``, ``"min"`` or ``fold(acc, y_t, t)``; reduces inside the loop.
        batch_first: inputs and outputs are ``(B, T, ...)``.
        budget: the training step's peak device memory (bytes or ``"2GiB"``; the one account
            of `spikeckpt.plans.account`: the input while it is on the device, outputs,
            ``.grad`` and the engine's gradient buffers, activations and checkpoints, the host
            tier's too on a CPU run): ``plan="auto"`` chooses within it, a plan given is
            checked against it. Parsed here, once.
        output: per step, ``None`` (default: what the model's own per-step call returns:
            the last layer's output, or the tuple an snnTorch net ending with an
            ``output=True`` neuron returns, ``spk, mem = net(x_t)`` (``spk, syn, mem`` for
            ``Synaptic``, ...), stacked over time: ``spk_rec, mem_rec = seq(x)``),
            ``"spikes"`` (the last layer's output), ``"mem"`` (the last layer's membrane
            potential) or ``"both"`` (a ``(spikes, mem)`` tuple).
        granularity: ``"stack"`` (default: the whole model is one step of [`scan`][spikeckpt.engine.scan.scan]; any
            recurrence), ``"layer"`` (layer-wise, `spikeckpt.engine.layerwise`: each
            block's input spike train stored packed in ``storage``, blocks recomputed one at a
            time per time chunk; the model must be a flat ``nn.Sequential`` of blocks, stateless
            synapse layers then one neuron, else ``UnsupportedLayerError`` says why) or
            ``"auto"`` (when the model splits into such blocks and the readout is not
            callable, [`spikeckpt.planning.Planner`][spikeckpt.planning.decide.Planner] measures one
            step per block and the layer-wise step at a few chunk lengths; it is used when its
            modeled whole step fits the budget, or the stack plan's own modeled step without
            one, and its calibrated time is at most 5% above the stack plan's; stack
            otherwise; decided once per ``(T, B)``). With layer-wise, ``seq.last_stats`` is a
            [`LayerwiseStats`][spikeckpt.engine.stats.LayerwiseStats] (spike density per block, bytes
            the codecs saved); ``storage="device"`` keeps the trains unpacked on the device.
        chunk: layer-wise time steps per chunk (default: the plan's interval, e.g. ``Uniform(k)``
            -> ``k``, else ``ceil(sqrt(T))``); refused with ``granularity="stack"``.
        directory: parent folder of the disk tier's files (``storage="disk"`` only).
        pack_tape: keep the binary tensors autograd saves in taped steps packed (see
            [`scan`][spikeckpt.engine.scan.scan]); the stack granularity's tape only: refused
            with ``granularity="layer"`` or ``"auto"`` (layer-wise keeps one block's chunk
            taped and stores its spike trains packed already).
        params: tensors requiring grad that the model uses besides what is found: its
            parameters and the leaf tensors requiring grad held as attributes of its modules
            (``self.beta = torch.full(..., requires_grad=True)``) or in Norse's ``p``. A tensor
            requiring grad that the model uses and that is none of these raises
            [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] naming the layer: pass it here.
        fuse: layer-wise only: run each neuron the adapters know (snnTorch ``Leaky``, ``RLeaky``,
            ``Synaptic``, ``RSynaptic``, ``Alpha``, ``Lapicque``; Norse's LIF and LI cells,
            ``LSNNRecurrentCell``: docs/speed.md) over a chunk fused; False: per step.
            ``seq.last_stats.blocks[i].neuron`` says how each block's neuron ran.
        compile: layer-wise, fused neurons: True compiles their forward with
            ``torch.compile`` (`spikeckpt.engine.compiled`: eager's rounding asked of inductor,
            checked bitwise against the eager forward on each shape's first chunk); ``"auto"``
            (default) and False keep it eager (no faster where measured). Without a compiler:
            eager, with one line.
            Stack granularity: True compiles the model's step (`spikeckpt.engine.compiled_step`:
            seconds once per shape; outputs bitwise, gradients inductor sums at round-off; 3 x 8
            neurons: 0.4x the eager time); "auto" compiles a shape's step once its eager
            forward calls took 5 s and keeps it where faster (`spikeckpt.engine.auto_compile`);
            False keeps it eager (`last_stats.step_compiled` says which ran).
        exact: layer-wise only. False (default): fast synapses: a chunk's inputs go through
            one product, and a ``Linear`` (or a Norse ``LIFRecurrentCell``'s input weights)
            over a sparse spike input (the first block's, on the CPU) sums the weight columns
            of the input's ones (3.6-4.7x faster on the peers' benchmark); both may round
            otherwise than the plain loop's per-step products, so a membrane within round-off
            of the threshold may spike differently (2 of 160,000 output spikes at T = 1000 on
            an H200; 20 of 65.5 million at n = 8192 on the CPU). True: every synapse runs
            step by step, as the plain loop runs it: spikes and membranes bitwise the loop's
            on any device (`spikeckpt.adapters.layered`), the neuron fused. (Random draws: with
            Dropout in two or more blocks, layer-wise draws a chunk's masks block by block,
            not in the loop's order: other masks than the loop's under the same seed, with
            gradients exact for them, and warns once; the stack draws in the loop's order. A model
            called on the whole sequence, Norse's ``Lift``/``LIF`` stacks, draws each Dropout's
            masks for every step first: with Dropout at two or more positions, wrap warns.)

    Every forward keeps its [`ScanStats`][spikeckpt.engine.stats.ScanStats] in
    ``seq.last_stats``. An unknown keyword is a ``TypeError`` here, not at the first forward.

    Raises:
        UnsupportedLayerError: a layer cannot be stepped; the message names it (its path in
            the model) and lists what is supported.
        ConfigError: an option the granularity cannot run (the message says which works).
    """
    check_model(model, wrapped=isinstance(model, CheckpointedSequence))
    if output is not None and output not in _OUTPUTS:
        raise ConfigError(f"output must be None or one of {_OUTPUTS}, got {output!r}")
    check_plan(plan)
    check_granularity(granularity)
    check_options(granularity, readout, chunk, pack_tape)
    check_params(params)
    check_storage(storage, directory)
    if budget is not None:  # parsed once, here: a budget that cannot be read fails at wrap
        budget = parse_bytes(budget)
    adapter = adapter_for(model, "")
    adapter.cleanup()
    follows_call = output is None
    as_call = follows_call and adapter.returns_more
    output = ("both" if as_call else "spikes") if output is None else output
    if output != "spikes" and not as_call and not has_membrane(adapter):
        raise no_membrane(output, adapter)
    seq = CheckpointedSequence(
        model,
        adapter,
        plan=plan,
        storage=storage,
        readout=readout,
        batch_first=batch_first,
        budget=budget,
        output=output,
        as_call=as_call,
        granularity=granularity,
        chunk=chunk,
        directory=directory,
        pack_tape=pack_tape,
        params=params,
        fuse=fuse,
        compile=compile,
        exact=exact,
    )
    seq.follows_call = follows_call
    dropouts = norse_sequence_dropouts(model)
    if dropouts is not None:
        warn_in_callers_code(dropouts)
    return seq


def unwrap(seq: nn.Module) -> nn.Module:
    """The original model of a [`CheckpointedSequence`][spikeckpt.wrapping.CheckpointedSequence] (``seq`` itself otherwise)."""
    return seq.module if isinstance(seq, CheckpointedSequence) else seq
