"""``torch.compile`` for the engine's fused neurons: one switch, one fallback.

A fused chunk kernel's forward (`spikeckpt.engine.fused`) is a loop of a few elementwise
ops per step; compiled, it becomes one kernel per chunk (Triton on CUDA, C++ on CPU). It did
not pay where it was measured, so ``compile="auto"`` (the default) leaves it eager and only
``compile=True`` compiles:

- **CPU** (the 2-core development machine, one thread, 16 x 512 and 16 x 2048 neurons, chunks
  of 25 steps): inductor's C++ kernel of the LIF recurrence took 2.2-2.4x the eager torch
  loop's time (it wins only below ~32 neurons, where the eager ops are all overhead); the
  eager kernel's recurrence is compiled by Numba (`spikeckpt.adapters.jit_loops`), and
  against it inductor's whole chunk took 9-13 ms per chunk of 25 x 16 x 512 where the eager
  kernel's forward took well under 1 ms (the peers' benchmark's step: 0.53 s against 0.036 s).
- **CUDA** (an H200, torch 2.11, the peers' benchmark): the compiled forward took 0.105 s
  against the eager kernel's 0.101 s at 16 x 512 neurons and 0.117 s against 0.0918 s at
  16 x 2048, after 9-12 s of compiling; Triton's forward differed from the eager one on some
  shapes (kept eager by the check below), and the chunk lengths and grad modes of one run
  reached dynamo's recompile limit (since then each key compiles its own copy, `own_code`,
  and the kernels trace without graph breaks: no host loop, no value read while compiling).
  On an H100 (2026-11-27) the check kept it eager at 16 x 512. Triton contracts ``a * b + c``
  into one FMA where eager CUDA rounds each op; every compile here now passes
  `eager_numerics` (no FP fusion, eager's rounding of fp16 / bf16 and of division), not yet
  run on a GPU.

Compiling costs seconds once per shape (2-17 s measured on CPU); inductor caches the compiled
code across processes (``TORCHINDUCTOR_CACHE_DIR``, by default under the system temp folder),
so later runs pay far less. A compiled forward is checked bitwise against the eager one on the
first chunk of each shape and timed against it there (`compiled_is_faster`), and used only
where equal and no slower (else the stats say "fused" for those chunks, and one line why).
When no compiler is available (no C++ compiler on CPU, no Triton on CUDA, a torch without
``torch.compile``) or compiling fails, the kernel runs eagerly and one line says so (a
`UserWarning`, once per reason).

Under an active ``TorchDispatchMode`` (``MemoryMeter(mode="tensors")``, the planner's probes on
the CPU) the compiled paths run the eager code and never call the compiled function
(`under_dispatch_mode`): dynamo skips a frame called under such a mode, and torch up to 2.13
then runs that code eagerly for the rest of the process (checked with torch 2.13 on the CPU;
the H200's torch 2.11 showed it; 2.14 compiles it again once the mode is gone).
"""

from __future__ import annotations

import functools
import shutil
import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from spikeckpt.engine.fused import ChunkKernel, Emit, Emitted

__all__ = [
    "COMPILE_CHOICES",
    "Compile",
    "CompiledKernel",
    "compiled_is_faster",
    "compiled_kernel",
    "compiler_missing",
    "eager_numerics",
    "is_compiling",
    "note_eager",
    "own_code",
    "under_dispatch_mode",
    "wants_compile",
]

Compile = bool | Literal["auto"]
COMPILE_CHOICES: tuple[Any, ...] = (True, False, "auto")
_WARNED: set[str] = set()


def note_eager(reason: str) -> None:
    """One line, once per reason: why a compiled path runs eagerly."""
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"spikeckpt: running eagerly: {reason}", UserWarning, stacklevel=4)


#: whether ``torch.compile`` is tracing the code that asks (``torch.compiler.is_compiling``;
#: a torch without it never compiles)
is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_compiling", lambda: False)


def under_dispatch_mode() -> bool:
    """Whether a ``TorchDispatchMode`` is active: compiled code must not be called (see the
    module docstring)."""
    return bool(_get_current_dispatch_mode_stack())


def own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method) through a copy of its function with a code object of its
    own (any other callable as it is).

    Dynamo keeps its compiled entries per code object, at most ``recompile_limit`` (8) of
    them, and beyond runs the function eagerly, silently to its caller: every wrapped model
    shares the wrapper's ``step`` code and every fused neuron of a kind its kernel's
    ``forward``, so a few models, layers, shapes and grad modes would use them up. Each copy
    compiles into entries of its own."""
    function = getattr(method, "__func__", None)
    owner = getattr(method, "__self__", None)
    if not isinstance(function, types.FunctionType) or owner is None:
        return method
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(copy, owner)


#: inductor settings that keep eager's rounding in generated Triton code: no contraction of
#: a product and a sum into one FMA (``emulate_precision_casts`` turns Triton's
#: ``enable_fp_fusion`` off; eager CUDA rounds every op), fp16 / bf16 rounded between fused
#: ops as eager does, and ``x / y`` correctly rounded (Triton's default is an approximate
#: division). The C++ backend already compiles without contraction (``-ffp-contract=off``).
EAGER_NUMERICS = {
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
}


@functools.cache
def eager_numerics() -> dict[str, Any]:
    """`EAGER_NUMERICS` as inductor options, those this torch's inductor has (2.14 has
    both; an older one may lack the second, then its division stays Triton's)."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - a torch without inductor
        return {}
    found: dict[str, Any] = {}
    for key, value in EAGER_NUMERICS.items():
        owner: Any = config
        *path, name = key.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            found[key] = value
    return found


@functools.cache
def compiler_missing(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run on ``device_type`` here, or None when it can."""
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if device_type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            return "Triton is not available to torch.compile"
        return None if has_triton() else "Triton is not installed (pip install triton)"
    if device_type == "cpu":
        return None if shutil.which("g++") or shutil.which("clang++") else "no C++ compiler found"
    return f"torch.compile is not used on {device_type!r} devices"


def wants_compile(choice: Compile, device: torch.device) -> bool:
    """Whether a run on ``device`` compiles its fused neurons for ``choice`` (True only:
    ``"auto"`` is eager, see the module docstring)."""
    if choice is not True:
        return False
    missing = compiler_missing(device.type)
    if missing is not None:
        note_eager(missing)
        return False
    return True


class CompiledKernel:
    """A `ChunkKernel` whose forward runs compiled.

    The backward stays eager (its loop is one or two ops per step; it calls autograd for the
    surrogate's derivative). Any failure to compile or run compiled falls back to the eager
    forward, with one line.
    """

    name = "compiled"

    def __init__(self, kernel: ChunkKernel) -> None:
        self.kernel = kernel
        self.membrane = kernel.membrane
        self.emits_states = kernel.emits_states
        self.failed = False
        #: per key (shape, dtype, device, flags, grad mode): its compiled forward, each a
        #: copy with a code object of its own (`own_code`), so it holds one dynamo entry and
        #: no run's keys reach dynamo's recompile limit (which runs eagerly past it, unseen)
        self.compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        #: per key: whether the compiled forward is used
        self.choice: dict[tuple[Any, ...], bool] = {}
        #: how the last forward ran: ``"compiled"``, or ``"fused"`` (the eager kernel: a
        #: shape whose compiled forward differed or was slower, or a failed compile)
        self.ran = "compiled"

    @property
    def params(self) -> tuple[Tensor, ...]:
        return self.kernel.params

    @property
    def binary_leaves(self) -> tuple[int, ...]:
        return self.kernel.binary_leaves

    @property
    def binary_output(self) -> bool:
        return self.kernel.binary_output

    def accepts(self, leaves: Sequence[Tensor], z: Tensor) -> bool:
        return self.kernel.accepts(leaves, z)

    def forward(
        self,
        leaves: list[Tensor],
        z: Tensor,
        keep: bool,
        want_mem: bool,
        want_y: bool = True,
        into: Tensor | None = None,
        emit: Emit = None,
    ) -> tuple[list[Tensor], Tensor | None, Emitted, Any]:
        """The compiled forward (``y`` always made and ``into`` not used: one compiled graph
        per shape)."""
        flags = (keep, want_mem, emit)
        key = (tuple(z.shape), z.dtype, z.device, *flags, torch.is_grad_enabled())
        use = self.choice.get(key)
        self.ran = "fused"
        if self.failed or use is False or under_dispatch_mode():
            return self.kernel.forward(leaves, z, keep, want_mem, emit=emit)
        try:
            if use is None:
                use = self._first(key, leaves, z, flags)
            if use:
                result = self.compiled[key](leaves, z, keep, want_mem, True, None, emit)
                self.ran = "compiled"
                return result
        except Exception as error:  # noqa: BLE001 - any compiler failure: run eagerly
            self.failed = True
            note_eager(f"torch.compile failed on a fused neuron ({type(error).__name__}: {error})")
        return self.kernel.forward(leaves, z, keep, want_mem, emit=emit)

    def _first(
        self, key: tuple[Any, ...], leaves: list[Tensor], z: Tensor, flags: tuple[Any, ...]
    ) -> bool:
        """The first chunk of a key: compile a copy of the forward for it, check it against
        the eager one (states, spikes and membranes bitwise) and time both; use it only
        where equal and no slower. Remembers and returns the choice. ``flags``: ``(keep,
        want_mem, emit)``."""
        args = (leaves, z, *flags[:2], True, None, flags[2])  # forward's, positional
        compiled = torch.compile(
            own_code(self.kernel.forward), dynamic=False, options=eager_numerics()
        )
        self.compiled[key] = compiled
        got = compiled(*args)  # compiles
        want = self.kernel.forward(*args)
        same = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(_outputs(got), _outputs(want), strict=True)
        )
        if not same:
            note_eager("a compiled fused neuron differed from the eager one (kept eager)")
        use = same and compiled_is_faster(compiled, self.kernel.forward, args)
        if same and not use:
            note_eager("a compiled fused neuron was slower than the eager one (kept eager)")
        self.choice[key] = use
        return use

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel.backward(*args, **kwargs)


#: interleaved timed calls of each forward, the minimum taken, to choose between them
TIMED_CALLS = 3


def compiled_is_faster(
    compiled: Callable[..., Any], eager: Callable[..., Any], args: tuple[Any, ...]
) -> bool:
    """Whether ``compiled(*args)`` (compiled already) took no longer than ``eager(*args)``:
    the minimum of `TIMED_CALLS` interleaved calls each (the device synchronized around each
    on CUDA). A chunk's forward costs micro- to milliseconds, the measurement a few chunks
    once per key; both give the same values (checked before), so only time is at stake."""
    tensor = args[1]
    sync = torch.cuda.synchronize if tensor.device.type == "cuda" else (lambda: None)
    best = {id(compiled): float("inf"), id(eager): float("inf")}
    for _ in range(TIMED_CALLS):
        for fn in (compiled, eager):
            sync()
            start = time.perf_counter()
            fn(*args)
            sync()
            best[id(fn)] = min(best[id(fn)], time.perf_counter() - start)
    return best[id(compiled)] <= best[id(eager)]


def _outputs(result: Any) -> list[Tensor | None]:
    """A kernel forward's tensors: final leaves, spikes, membranes or emitted leaves (not
    what it saves)."""
    final, y, mem, _ = result
    return [*final, y, *(mem if isinstance(mem, tuple) else [mem])]


#: the attribute a kernel keeps its `CompiledKernel` in: it lives (and its compiled code
#: with it) as long as the kernel, which its wrapped model holds; no module-level table keeps
#: a model's kernels, modules and parameters alive after the model is gone
_COMPILED_ATTR = "_spikeckpt_compiled"


def compiled_kernel(kernel: ChunkKernel) -> CompiledKernel:
    """The one `CompiledKernel` of ``kernel`` (its compiled code is kept with it)."""
    found = getattr(kernel, _COMPILED_ATTR, None)
    if not isinstance(found, CompiledKernel):
        found = CompiledKernel(kernel)
        setattr(kernel, _COMPILED_ATTR, found)
    return found
