"""Backpropagating one taped segment: ``torch.autograd.grad`` without its Python front end,
and the parameter gradients accumulated so far fed back in so sums run in plain-loop order.

Both granularities (the schedule executor and the layer-wise job) take their segment
gradients through `grad`, feeding earlier contributions with `FeedGrads`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.overrides import has_torch_function

from spikeckpt.engine.rng import rejoin_backward_draws
from spikeckpt.errors import UnlistedParamsError, UsageError

if TYPE_CHECKING:
    from torch.autograd.graph import Node


class GradSink:
    """Where an op's backward may add a parameter's gradient in place, instead of returning a
    new parameter-sized tensor for the caller to add to its running sum.

    The engine sets `target` to its running sum of the parameter's gradient (or None
    before the first contribution) around each backward pass of the block (`active`); an
    op that supports the sink adds its contribution into ``target`` in place (creating it,
    parameter-shaped, when None) and returns no gradient for the parameter; the engine then
    takes ``target`` as the sum. Sums keep their order: ``sum + contribution``, elementwise,
    as the plain loop's.

    Attributes:
        target: the running sum (parameter-shaped) or None.
        active: whether the engine is collecting through this sink now (an op ignores an
            inactive sink and returns its gradient as usual).
    """

    def __init__(self) -> None:
        self.target: Tensor | None = None
        self.active = False


class FeedGrads(torch.autograd.Function):
    """Feeds the parameter gradients accumulated so far into a segment's backward pass.

    ``FeedGrads.apply(box, *params)`` returns a dummy scalar; backpropagating it (with any
    gradient) makes autograd take ``box.pop()`` (one tensor per parameter) as the first
    contribution to each parameter's gradient, before the segment's own contributions arrive
    (its node is the newest, so the engine runs it first). The sum then runs in the same order
    as one backward pass over the whole loop: bitwise-equal gradients.

    Unlike feeding them through ``p.view_as(p)`` outputs, the tensors are handed over: once
    ``backward`` returns, autograd holds the only reference, so it adds the segment's
    contributions into them in place (no fresh parameter-sized buffer per segment, which on
    CPU costs page faults and a strided add: about 0.3 ms per segment for a 2x256 LIF net). The
    engine still adds out of place whenever anything else references the tensor, so this never
    changes a tensor someone else can see.
    """

    @staticmethod
    def forward(ctx: Any, box: list[tuple[Tensor, ...]], *params: Tensor) -> Tensor:  # type: ignore[override]
        ctx.box = box
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = ctx.box.pop()
        ctx.box = None
        return (None, *grads)


def _engine_grad() -> Callable[..., tuple[Tensor | None, ...]] | None:
    """``torch.autograd.grad`` minus its Python front end, if this torch has the engine call.

    ``torch.autograd.grad`` re-checks every output/gradient pair in Python (``_make_grads``:
    about 30 us per output on CPU) before calling the engine, which checks them again in C++
    (shape, dtype, device of each root gradient). With thousands of small segments (Revolve
    tapes single steps) that front end is ~0.1 ms per backpropagation. Returns ``None`` (use
    ``torch.autograd.grad``) when the private entry point is missing or behaves differently.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:  # pragma: no cover - older or newer torch
        return None

    def grad(
        outputs: Sequence[Tensor], inputs: Sequence[Tensor], grads: Sequence[Tensor]
    ) -> tuple[Tensor | None, ...]:
        # (outputs, grads, keep_graph, create_graph, inputs, allow_unreachable, accumulate)
        return run(tuple(outputs), tuple(grads), False, False, tuple(inputs), True, False)

    try:  # check it on a tiny graph, once
        with torch.enable_grad():
            x = torch.ones(2, requires_grad=True)
            unused = torch.ones(1, requires_grad=True)
            y = x * 3.0
            got = grad([y], [x, unused], [torch.full((2,), 2.0)])
        if (
            len(got) != 2
            or got[1] is not None
            or got[0] is None
            or not torch.equal(got[0], torch.full((2,), 6.0))
        ):
            return None  # pragma: no cover
    except Exception:  # noqa: BLE001 - any surprise: use the public API  # pragma: no cover
        return None
    return grad


_ENGINE_GRAD: list[Callable[..., tuple[Tensor | None, ...]] | None] = []  # checked on first use


def grad(
    outputs: list[Tensor], inputs: list[Tensor], grads: list[Tensor]
) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, allow_unused=True)``, without retain,
    the inputs' tensor hooks held back (`tensor_hooks_held`), autocast off as in a plain
    loop's backward (the recomputation inside a backward runs under the forward's autocast;
    the backward formulas under it failed on an fp16 input under bf16 autocast, "Unexpected
    floating ScalarType in at::autocast::prioritize", where the loop's backward runs)."""
    if not _ENGINE_GRAD:
        _ENGINE_GRAD.append(_engine_grad())
    engine = _ENGINE_GRAD[0]
    rejoin_backward_draws()  # a backward function that draws continues the backward's stream
    with tensor_hooks_held(inputs), _autocast_off(), _freed_graph_named():
        if (
            engine is not None
            and not has_torch_function(outputs)
            and not has_torch_function(inputs)
            and not has_torch_function(grads)
        ):
            return engine(outputs, inputs, grads)
        return torch.autograd.grad(outputs, inputs, grads, allow_unused=True)


#: why a recomputed step reaches a graph already freed, and the ways out
FREED_GRAPH = (
    "spikeckpt: a recomputed step reached the graph of another step, already freed. Either "
    "the loss uses a tensor a forward hook kept from a wrapped run's taped step (hooks are for "
    "watching values: detach them; return what the loss needs from the model instead: "
    "output='both' for the last neuron's membrane, Norse's return_hidden=True, or a step "
    "whose output includes the hidden spikes), or the step keeps state outside its arguments "
    "(snnTorch neurons built with init_hidden=True called inside a scan step, or a tensor "
    "assigned on a module, self.x = ...), which a plan that recomputes steps replays out of "
    "order: pass that state in and return it (snnTorch: init_hidden=False, spk, mem = "
    "lif(cur, mem); a neuron of yours: forward(x, state) -> (y, state)), or use "
    "plan=spikeckpt.plans.BPTT(), which does not recompute, with an initial state of full "
    "shape (or ()): from None, empty or 0-d leaves step 0 runs apart and its graph is freed "
    "before your backward reaches it"
)


@contextlib.contextmanager
def _freed_graph_named() -> Iterator[None]:
    """torch's "backward through the graph a second time" inside the engine's backward,
    with its cause in a checkpointed run named (`FREED_GRAPH`)."""
    try:
        yield
    except RuntimeError as err:
        if "backward through the graph a second time" not in str(err):
            raise
        raise UsageError(f"{FREED_GRAPH}\n(torch: {str(err).splitlines()[0]})") from err


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Autocast off for each device type where it is on (no change elsewhere)."""
    with contextlib.ExitStack() as stack:
        for kind in ("cpu", "cuda"):
            if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def grads_held(params: Sequence[Tensor]) -> bool:
    """Whether a ``.grad`` is held on one of ``params`` that require grad (gradients
    accumulating over calls): a step's own sums are added into it, and both are held."""
    return any(p.grad is not None for p in params if p.requires_grad)


@contextlib.contextmanager
def tensor_hooks_held(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Hold back the hooks registered on ``tensors`` (``p.register_hook(fn)``: a per-layer
    gradient scale, a clamp) while the engine takes gradients with respect to them.

    The engine differentiates a parameter once per segment (or chunk, or probe), each time
    with respect to the sum so far; autograd would run the parameter's hooks on each of those
    partial sums, and again on the whole gradient the engine hands back (a hook scaling by 0.1
    left 0.033x the loop's gradient after the 6 segments of ``Uniform(4)`` on 21 steps).
    Held back here, they run once, on the whole gradient, as in the plain loop's backward.
    Hooks registered meanwhile stay, after the ones put back."""
    held: list[tuple[dict[Any, Any], list[tuple[Any, Any]]]] = []
    for tensor in tensors:
        hooks = tensor._backward_hooks
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            added = list(hooks.items())
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


def leaves_behind(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The leaves requiring grad behind the graphs of the computed ones among ``tensors``
    (``raw`` of a Norse ``p`` field ``0.2 + sigmoid(raw)`` computed before the call)."""
    computed = [t for t in tensors if t.grad_fn is not None]
    return unseen_leaves(computed, []) if computed else []


def not_behind(params: list[Tensor]) -> list[Tensor]:
    """``params`` without the leaves behind another one's graph: ``raw`` of a Norse ``p``
    field ``softplus(raw) * 100`` computed before the call, both differentiated. Autograd
    carries the field's gradient on to ``raw``; differentiated in each step too, its graph
    was backpropagated once per step (torch's "backward through the graph a second time")."""
    behind = {id(t) for t in leaves_behind(params)}
    return [p for p in params if id(p) not in behind] if behind else params


def behind_computed(found: Sequence[Tensor], params: Sequence[Tensor]) -> list[Tensor]:
    """Those of ``found`` (leaves a step uses directly, not differentiated) that are behind a
    computed tensor among ``params`` (left out by `not_behind`): used both ways."""
    behind = {id(t) for t in leaves_behind(params)}
    return [t for t in found if id(t) in behind]


def used_both_ways(who: str, tensors: Sequence[Tensor]) -> str:
    """The message for ``tensors`` used by ``who`` directly and through a computed tensor
    the run differentiates (`behind_computed`)."""
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors[:5])
    return (
        f"{who} {len(tensors)} tensor(s) requiring grad (shapes {shapes}) directly, and "
        "through a tensor computed from them before the call that the run differentiates (a "
        "Norse p field such as v_th = 0.2 + torch.sigmoid(raw)): the run hands that tensor's "
        "gradient on to them once, and cannot also differentiate their direct use inside the "
        "steps. Compute the field inside the step instead: a subclass of the cell whose "
        "forward builds the parameters from raw and calls Norse's functional step with them "
        "(not setting self.p)"
    )


def unlisted_in_block(
    name: str, strangers: Sequence[Tensor], params: Sequence[Tensor]
) -> UnlistedParamsError:
    """The error for the layer-wise block whose neuron is layer ``name``: its taped graph
    reaches ``strangers``, leaves requiring grad that are not among the run's ``params``."""
    both = behind_computed(strangers, params)
    if both:
        who = f"layer-wise run: the block whose neuron is layer {name!r} uses"
        return UnlistedParamsError(used_both_ways(who, both), both)
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in strangers[:5])
    return UnlistedParamsError(
        f"layer-wise run: the block whose neuron is layer {name!r} (it and the layers before "
        f"it) uses {len(strangers)} tensor(s) requiring grad that are not among the "
        f"parameters it differentiates (shapes {shapes}); they would get no gradient. "
        "Register them as nn.Parameter, hold them as attributes of the block's modules, or "
        "pass them: wrap(model, ..., params=[tensor, ...]) (layerwise_scan(..., params=[...]))",
        list(strangers),
    )


def unseen_leaves(roots: Sequence[Any], known: Sequence[Any], limit: int = 20000) -> list[Tensor]:
    """The leaf tensors requiring grad in the autograd graph of ``roots`` (tensors; others are
    skipped) that are not (by identity) in ``known``: tensors a step uses without the engine
    differentiating them. Walks at most ``limit`` graph nodes; stops at the nodes of known
    tensors that are not leaves (a weight ``w = log_w.exp()`` computed before the loop and
    passed as a parameter: the engine differentiates ``w``, autograd carries it on to
    ``log_w``)."""
    stack: list[Node | None] = [
        t.grad_fn for t in roots if isinstance(t, Tensor) and t.grad_fn is not None
    ]
    # Node wrappers may be transient: keep them alive so their ids are not reused.
    visited: list[Any] = [
        t.grad_fn for t in known if isinstance(t, Tensor) and t.grad_fn is not None
    ]
    seen: set[int] = {id(node) for node in visited}
    known_ids = {id(t) for t in known}
    found: list[Tensor] = []
    while stack and len(visited) < limit:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        visited.append(node)
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known_ids:
            known_ids.add(id(variable))
            if variable.requires_grad:  # one stopped since (a probe without gradients)
                found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def in_layout(grad: Tensor | None, param: Tensor) -> Tensor | None:
    """``grad`` in ``param``'s layout (a copy where its strides differ: a small weight's sum
    kept transposed), so that autograd takes it as ``.grad`` (a ``.grad`` None) instead of
    copying it after the run: the copy is made here, where the working-set probe sees it.
    A sparse gradient (``nn.Embedding(sparse=True)``) is handed over as it is, as autograd
    takes it (a copy into the strided layout failed before 2026-11-29)."""
    if grad is None or grad.layout != torch.strided or grad.stride() == param.stride():
        return grad
    return torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
