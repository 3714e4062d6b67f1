"""The layer-wise loop as a job of the engine's autograd Function: forward block by block over
each time chunk, storing each block's input train packed and the chunk-boundary states;
backward chunks in reverse, blocks top-down (see `spikeckpt.engine.layerwise`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from spikeckpt.engine import tree as pytree
from spikeckpt.engine.amp import autocast_on
from spikeckpt.engine.blocks import LayerBlock, stacked_outputs
from spikeckpt.engine.compiled import Compile, compiled_kernel, wants_compile
from spikeckpt.engine.direct import UntapedParts, untaped_backward, untaped_parts
from spikeckpt.engine.function import SECOND_BACKWARD, Job
from spikeckpt.engine.fused import ChunkKernel, Emit, run_fused
from spikeckpt.engine.grad import GradSink, grad, in_layout, unlisted_in_block, unseen_leaves
from spikeckpt.engine.inputs import SparseChunk, chunk_of, is_packed, sparse_chunk_of
from spikeckpt.engine.phase import recomputing
from spikeckpt.engine.readout import Reducer
from spikeckpt.engine.rng import RngState
from spikeckpt.engine.stats import LayerwiseStats
from spikeckpt.errors import ConfigError, UsageError
from spikeckpt.storage.base import tensor_nbytes
from spikeckpt.storage.codecs import Packed, binary_mask, count_binary, pack, unpack
from spikeckpt.storage.tiers import make_store

__all__ = ["DIRECT_BACKWARD", "GATHER_MIN_OUTPUTS", "GROUP_SHARE", "LayerwiseJob"]

#: an off-device store entry collects consecutive chunks' trains and states until it holds
#: this share of one chunk's dense input trains (all blocks): fewer, larger files (see
#: `LayerwiseJob`). At most two entries are on the device at once (the one in use and the
#: one being prefetched), against the unpacked input chunk and its gradient that the
#: backward of each block holds anyway (the cost model's ``2 * chunk * I_b``).
GROUP_SHARE = 0.25
State = Any

#: whether blocks with an affine synapse into a fused neuron run their recomputation and
#: backward untaped (`spikeckpt.engine.direct`); False tapes every block (for comparisons)
DIRECT_BACKWARD = True

#: a block after the first gathers over its input spikes only with at least this many outputs
#: (measured, CPU, one thread, 5% of BPTT's memory, T = 1000: 256 -> 256 at batch 32 0.48x the
#: snnTorch loop gathered against 0.55x dense; 256 -> 10 at batch 16 0.43x against 0.37x, where
#: the gather's fixed cost per chunk outweighs a small product)
GATHER_MIN_OUTPUTS = 64


def _nbytes(t: Tensor) -> int:
    return tensor_nbytes(t)


def _split(flat: Sequence[Any], counts: Sequence[int]) -> list[list[Any]]:
    """``flat`` cut into consecutive lists of ``counts[i]`` items."""
    out, i = [], 0
    for n in counts:
        out.append(list(flat[i : i + n]))
        i += n
    return out


class LayerwiseJob(Job):
    """Forward and backward of the layer-wise loop.

    Function inputs: (x, *state leaves of every block, *params); outputs: (*readout outputs,
    *final state leaves of every block).
    """

    def __init__(
        self,
        blocks: Sequence[LayerBlock],
        state_defs: list[Any],
        n_leaves: list[int],
        params: list[Tensor],
        *,
        T: int,
        chunk: int,
        readout: str | None,
        output: str,
        storage: str,
        directory: str | os.PathLike[str] | None,
        stats: LayerwiseStats,
        device: torch.device,
        cuda: Sequence[int],
        group: int | None = None,
        fuse: bool = True,
        compile: Compile = False,
    ) -> None:
        super().__init__(device, cuda, storage, directory, stats)
        self.fuse = fuse
        #: recompute and backpropagate affine-into-fused blocks without autograd
        self.direct = DIRECT_BACKWARD
        #: per block: whether a block after the first may gather over its input (`_gathers`)
        self.may_gather = [False] * len(blocks)
        #: ``(chunk, block)`` pairs whose forward pass gathered (a block after the first)
        self.gathered: set[tuple[int, int]] = set()
        #: per block, what its untaped backward uses (`_untaped_parts`)
        self.untaped_parts: dict[int, UntapedParts | None] = {}
        compiling = fuse and wants_compile(compile, device)
        self.kernels = [
            compiled_kernel(b.fused) if compiling and b.fused is not None else b.fused
            for b in blocks
        ]
        self.stats: LayerwiseStats = stats
        self.blocks = list(blocks)
        self.state_defs = state_defs
        self.n_leaves = n_leaves
        self.params = params
        ids = {id(p): j for j, p in enumerate(params)}
        self.block_params = [
            list(dict.fromkeys(ids[id(t)] for t in b.params if id(t) in ids)) for b in blocks
        ]
        self.T = T
        self.readout = readout
        self.output = output
        self.bounds = [(t0, min(t0 + chunk, T)) for t0 in range(0, T, chunk)]
        self.store: Any = None
        self.layout: dict[int, tuple[int, int, list[tuple[Packed | None, int, int]]]] = {}
        self.entry_data: tuple[int, list[Tensor]] | None = None
        self.group = group
        self.rng: dict[tuple[int, int], RngState] = {}
        self.x: Any = None
        self.initial: list[list[Tensor]] = []
        self.closed = False
        self.n_outputs = 0
        self.need_x = False
        self.need_state: list[bool] = []
        self.referenced = [0]  # backward reads x: it must not change in place before then
        self.owned: set[int] = set()  # parameter gradients that are sums this job allocated
        #: the forward pass's readout ("max"/"min" keep the index that gets the gradient)
        self.reducer: Reducer | None = None
        #: blocks whose taped graph was searched for tensors requiring grad outside their
        #: ``params`` (once per run, at the block's first backward chunk)
        self.searched: set[int] = set()

    # One store entry (a file on disk) holds what ``group`` consecutive chunks keep: their
    # input trains of blocks 1.. (packed here, so the codec figures are per block) and every
    # block's state at each chunk start. Each disk write and read costs a file, a pickle and
    # a thread hand-over (milliseconds on a CPU), against about a millisecond of compute per
    # chunk step: one entry per chunk and block would cost more than the recomputation.
    # ``self.layout[c] = (entry, offset, blocks)``: the chunk's entry, where its tensors start
    # in it and, per block, the train's ``Packed`` description without payload (None: kept
    # dense, device tier), its tensor count and the state's leaf count.

    def close(self) -> None:
        self.closed = True
        store, self.store = self.store, None
        if store is not None:
            store.close()
        self.rng.clear()
        self.layout.clear()
        self.entry_data = None
        self.x = None
        self.initial = []
        self.reducer = None
        for block in self.blocks:
            block.cleanup()

    # -- running one block over one chunk ------------------------------------------------
    def _run_block(
        self, c: int, b: int, inp: Tensor | SparseChunk, leaves: list[Tensor], top: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        """``(outputs, final state leaves)`` of block ``b`` over chunk ``c``; outputs:
        ``[spikes (k, B, ...)]`` below the top, the emitted outputs (spikes / mem / both, each
        ``(k, B, ...)``) at the top."""
        return self._run_neuron(b, self._run_synapse(c, b, inp), leaves, top)

    def _run_synapse(self, c: int, b: int, inp: Tensor | SparseChunk) -> Tensor:
        """Block ``b``'s synaptic input over chunk ``c``'s input ``inp``: ``(k, B, ...)``."""
        block = self.blocks[b]
        if self._sparse(c, b):
            return block.sparse_synapse(inp)  # type: ignore[misc]
        assert isinstance(inp, Tensor)
        return block.synapse(inp)

    def _forward_synapse(
        self, c: int, b: int, inp: Tensor | SparseChunk, leaves: list[Tensor]
    ) -> Tensor:
        """`_run_synapse` in the forward pass: a block after the first that may gather does,
        where its fused neuron accepts the chunk (its backward then runs untaped); the chunk
        is recorded in ``gathered``."""
        kernel, block = self.kernels[b], self.blocks[b]
        if b > 0 and self.may_gather[b] and kernel is not None:
            z = block.sparse_synapse(inp)  # type: ignore[misc]
            if kernel.accepts(leaves, z):
                self.gathered.add((c, b))
                return z
            del z
        return self._run_synapse(c, b, inp)

    def _sparse(self, c: int, b: int) -> bool:
        """Whether block ``b`` reads chunk ``c``'s input through its sparse synapse: the first
        block when ``x`` needs no gradient; a later one where the forward pass gathered (its
        backward runs untaped: its input gradient is ``dL/dz @ W``)."""
        if self.blocks[b].sparse_synapse is None:
            return False
        return (b == 0 and not self.need_x) or (c, b) in self.gathered

    def _gathers(self, b: int) -> bool:
        """Whether block ``b > 0`` gathers over its input spikes in both passes: an affine
        synapse of at least `GATHER_MIN_OUTPUTS` outputs into a fused neuron, untaped (see
        `_backward_untaped`), outside autocast."""
        affine = self.blocks[b].affine
        if b == 0 or not self.direct or self.blocks[b].sparse_synapse is None or affine is None:
            return False
        if affine.params[0].shape[0] < GATHER_MIN_OUTPUTS:
            return False
        if autocast_on(self.device):
            return False
        return self._untaped_parts(b) is not None

    def _run_neuron(
        self, b: int, z: Tensor, leaves: list[Tensor], top: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Block ``b``'s neuron over the chunk's synaptic input ``z`` (see `_run_block`)."""
        block = self.blocks[b]
        state = pytree.tree_unflatten(leaves, self.state_defs[b])
        want_mem = top and self.output != "spikes"
        kernel = self.kernels[b]
        fused = kernel is not None and self.fuse and kernel.accepts(leaves, z)
        if not fused:
            if not recomputing():
                self.stats.blocks[b].count_neuron("per-step")
            return self._run_steps(block, state, z, top, want_mem)
        assert kernel is not None
        result = self._run_fused(kernel, state, z, want_mem, block.emits if want_mem else None)
        if not recomputing():  # a compiled kernel says how it ran (it may keep a shape eager)
            self.stats.blocks[b].count_neuron(getattr(kernel, "ran", kernel.name))
        return result

    def _run_fused(
        self, kernel: ChunkKernel, state: State, z: Tensor, want_mem: bool, emit: Emit
    ) -> tuple[list[Tensor], list[Tensor]]:
        """A block's neuron over the chunk ``z`` in one fused computation (`run_fused`)."""
        state, y_all, mem_all = run_fused(kernel, state, z, want_mem, emit)
        self.stats.forward_steps += z.shape[0]
        final = pytree.tree_leaves(state)
        if not want_mem:
            return [y_all], final
        assert mem_all is not None
        mems = list(mem_all) if isinstance(mem_all, tuple) else [mem_all]
        return (mems if self.output == "mem" else [y_all, *mems]), final

    def _run_steps(
        self, block: LayerBlock, state: State, z: Tensor, top: bool, want_mem: bool
    ) -> tuple[list[Tensor], list[Tensor]]:
        """A block's neuron over the chunk ``z`` one step at a time."""
        spikes: list[Tensor] = []
        mems: list[Any] = []
        step = block.step
        # unbind, not z[t]: the backward of one select per step would allocate and fill a
        # zero (k, B, ...) gradient each time, O(k^2) in the chunk length; unbind's is one stack
        for z_t in z.unbind(0):
            state, y = step(state, z_t)
            spikes.append(y)
            if want_mem:
                mem = block.membrane(state)
                if mem is None:
                    raise ConfigError(
                        f"output={self.output!r} needs the top neuron ({block.name}) to have a "
                        "membrane potential"
                    )
                mems.append(mem)
        self.stats.forward_steps += z.shape[0]
        final = pytree.tree_leaves(state)
        if not top or self.output == "spikes":
            return [stacked_outputs(spikes, block.name)], final
        # a membrane given as a tuple of tensors is several outputs, each stacked
        stacked = (
            [torch.stack(list(m)) for m in zip(*mems, strict=True)]
            if isinstance(mems[0], tuple)
            else [torch.stack(mems)]
        )
        if self.output == "mem":
            return stacked, final
        return [stacked_outputs(spikes, block.name), *stacked], final

    # -- forward ---------------------------------------------------------------------------
    def forward(self, needs: Sequence[bool], tensors: Sequence[Tensor]) -> list[Tensor]:
        nl = sum(self.n_leaves)
        self.need_x, self.need_state = needs[0], list(needs[1 : 1 + nl])
        return self.run_forward(tensors[0], list(tensors[1 : 1 + nl]), True)

    def run_forward(self, x: Any, leaves: list[Tensor], record: bool) -> list[Tensor]:
        """The forward pass; ``record``: keep what backward needs (else a plain no-grad run)."""
        nb = len(self.blocks)
        states = [[t.detach() for t in s] for s in _split(leaves, self.n_leaves)]
        self.may_gather = [self._gathers(b) for b in range(nb)]
        self.gathered = set()
        if record:
            self.x = x if is_packed(x) else x.detach()
            self.initial = [list(s) for s in states]
            self.store = make_store(
                self.storage, self.device, self.stats.storage_ledger, self.directory
            )
        reducer = Reducer(self.readout, self.T)
        if record:
            self.reducer = reducer
        try:
            items: list[Tensor] = []  # the open entry's tensors
            entry, first = 0, 0  # the open entry and its first chunk
            for c, (t0, _) in enumerate(self.bounds):
                offset = len(items)
                outs, layout = self._forward_chunk(c, x, states, items, record)
                if record:
                    if len(items) > offset:
                        self.layout[c] = (entry, offset, layout)
                    if self._entry_full(c, first, items):
                        if items:
                            self.store.put(entry, items)
                        items, entry, first = [], entry + 1, c + 1
                reducer.emit_chunk(t0, outs)
        except BaseException:
            self.close()
            raise
        finally:
            for block in self.blocks:
                block.cleanup()
        outs = reducer.outputs()
        self.n_outputs = len(outs)
        if not record:
            self.close()
        return outs + [t for s in states for t in s]

    def _forward_chunk(
        self, c: int, x: Any, states: list[list[Tensor]], items: list[Tensor], record: bool
    ) -> tuple[list[Tensor], list[tuple[Packed | None, int, int]]]:
        """Every block over chunk ``c`` (``states`` updated in place; with ``record`` what
        backward needs added to the open entry's ``items``): the top block's outputs and the
        chunk's layout entries."""
        t0, t1 = self.bounds[c]
        inp: Any = self._first_input(x, t0, t1)
        layout: list[tuple[Packed | None, int, int]] = []
        outs: Any = None
        for b in range(len(self.blocks)):
            train = self._measure(b, inp, record)
            if record:
                layout.append(self._keep(c, b, train, states[b], items))
            z = self._forward_synapse(c, b, inp, states[b])
            inp = outs = None  # the input chunk goes before the neuron runs
            outs, states[b] = self._run_neuron(b, z, states[b], b == len(self.blocks) - 1)
            del z
            inp = outs[0]
        return outs, layout

    def _keep(
        self,
        c: int,
        b: int,
        train: Packed | Tensor | None,
        state: list[Tensor],
        items: list[Tensor],
    ) -> tuple[Packed | None, int, int]:
        """Add what backward needs of block ``b`` at chunk ``c`` to the open entry's
        ``items`` (its input train and, after the first chunk, its state at the chunk start;
        its RNG state when it draws random numbers); returns the block's layout entry."""
        meta, count = None, 0
        if isinstance(train, Packed):
            meta, count = train.with_payload(()), len(train.payload)
            items.extend(train.payload)
        elif train is not None:  # the device tier: the tensor itself
            count = 1
            items.append(train)
        n_state = len(state) if c > 0 else 0
        items.extend(state[:n_state])
        if self.blocks[b].draws_random:
            self.rng[(c, b)] = RngState.capture(self.cuda_devices)
        return meta, count, n_state

    def _first_input(self, x: Any, t0: int, t1: int) -> Tensor | SparseChunk:
        """The first block's input over steps ``t0 <= t < t1``: a packed train's chunk as the
        positions of its ones when the block's ``sparse_synapse`` will read it (no dense
        chunk is made), else the dense chunk."""
        block = self.blocks[0]
        if is_packed(x) and block.sparse_synapse is not None and not self.need_x:
            return sparse_chunk_of(x, t0, t1, self.device)
        return chunk_of(x, t0, t1, self.device).detach()

    def _measure(self, b: int, inp: Tensor | SparseChunk, record: bool) -> Packed | Tensor | None:
        """Count block ``b``'s input chunk in the stats; return what to store of it: None for
        the first block (the caller's ``x``, referenced) and without ``record``, the tensor
        itself on the device tier, else its ``Packed`` form (the ``auto`` codec)."""
        st = self.stats.blocks[b]
        if isinstance(inp, SparseChunk):  # the first block's packed input: binary, counted
            st.ones += inp.ones
            st.elements += inp.numel()
            st.dense_bytes += inp.numel() * inp.dtype.itemsize
            st.codecs["reference"] = st.codecs.get("reference", 0) + 1
            return None
        st.elements += inp.numel()
        st.dense_bytes += _nbytes(inp)
        if b == 0 or not record:  # counted, not stored: no mask to make
            ones, binary = count_binary(inp)
            st.ones += ones
            st.binary = st.binary and binary
            if b == 0:
                st.codecs["reference"] = st.codecs.get("reference", 0) + 1
            return None
        # one pass over the train: the binary test, the count of ones and the mask to pack
        found = binary_mask(inp)
        st.ones += found[1] if found is not None else int(torch.count_nonzero(inp))
        if found is None:
            st.binary = False
        stored: Packed | Tensor
        if self.store.kind == "device":
            stored, nbytes, codec = inp, _nbytes(inp), "device"
        else:
            stored = pack(inp, found=found)
            nbytes, codec = stored.nbytes, stored.codec
        st.stored_bytes += nbytes
        st.codecs[codec] = st.codecs.get(codec, 0) + 1
        return stored

    def _entry_full(self, c: int, first: int, items: list[Tensor]) -> bool:
        """Whether the open entry (chunks ``first .. c``) ends with chunk ``c``: always at the
        last chunk and on the device tier; every ``group`` chunks when it is given; else
        when one more chunk like these would take it past `GROUP_SHARE` of the first
        chunk's dense input trains."""
        if c == len(self.bounds) - 1 or self.store.kind == "device":
            return True
        if self.group:
            return (c + 1) % self.group == 0
        limit = GROUP_SHARE * sum(st.dense_bytes for st in self.stats.blocks) / (c + 1)
        held = sum(_nbytes(t) for t in items)
        return held + held / (c - first + 1) > limit

    # -- backward --------------------------------------------------------------------------
    def _prefetch(self, c: int) -> None:
        """Start reading the entry chunk ``c`` is in, unless it is the one in use."""
        if c < 0 or self.store is None or c not in self.layout:
            return
        entry = self.layout[c][0]
        if self.entry_data is None or self.entry_data[0] != entry:
            self.store.prefetch(entry)

    def _release(self, c: int) -> None:
        """Chunk ``c`` is done (in reverse order): drop its entry when it was the entry's
        first chunk."""
        if c not in self.layout:
            return
        entry = self.layout[c][0]
        if c == 0 or self.layout.get(c - 1, (None,))[0] != entry:
            self.entry_data = None
            self.store.drop(entry)

    def _stored(self, c: int, b: int) -> tuple[Tensor | None, list[Tensor] | None]:
        """Block ``b``'s input train (dense) and state at the start of chunk ``c`` from the
        store (None when not stored: the caller's ``x``, the initial state)."""
        if c not in self.layout:
            return None, None
        entry, at, blocks = self.layout[c]
        if self.entry_data is None or self.entry_data[0] != entry:
            self.entry_data = (entry, self.store.get(entry))
        tensors = self.entry_data[1]
        for block, (meta, count, n_state) in enumerate(blocks):
            if block == b:
                train = None
                if count:
                    part = tensors[at : at + count]
                    train = unpack(meta.with_payload(tuple(part)), self.device) if meta else part[0]
                state = tensors[at + count : at + count + n_state] if n_state else None
                return train, state
            at += count + n_state
        raise AssertionError(f"block {b} not in chunk {c}'s layout")  # pragma: no cover

    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        if self.closed or self.store is None:
            raise UsageError(
                "spikeckpt layer-wise scan: backward can run only once per forward (its stored "
                "spike trains are freed as it goes)" + SECOND_BACKWARD
            )
        n = self.n_outputs
        reducer = self.reducer if self.reducer is not None else Reducer(self.readout, self.T)
        out_grads = list(grads[:n])
        carry = _split(grads[n:], self.n_leaves)
        grad_x: Tensor | None = None  # made at the first gradient to reach x (None, as the loop's)
        grad_p: list[Tensor | None] = [None] * len(self.params)
        try:
            with self.backward_context():
                self._prefetch(len(self.bounds) - 1)
                for c in range(len(self.bounds) - 1, -1, -1):
                    t0, t1 = self.bounds[c]
                    self._prefetch(c - 1)
                    g_out = reducer.chunk_grad(out_grads, t0, t1)
                    for b in range(len(self.blocks) - 1, -1, -1):
                        g_out, carry[b] = self._backward_block(c, b, g_out, carry[b], grad_p)
                        if b == 0 and self.need_x and g_out[0] is not None:
                            grad_x = torch.zeros_like(self.x) if grad_x is None else grad_x
                            grad_x[t0:t1] = g_out[0]
                        self.stats.backward_chunks += 1
                    self._release(c)
                    self.stats.backward_steps += (t1 - t0) * len(self.blocks)
            self.stats.completed = True
        finally:
            self.close()
        need_state = self.need_state
        g_state = [g if need else None for g, need in zip(sum(carry, []), need_state, strict=True)]
        return [grad_x, *g_state, *map(in_layout, grad_p, self.params)]

    def _open_sinks(self, b: int, grad_p: list[Tensor | None]) -> list[tuple[int, GradSink]]:
        """Point block ``b``'s gradient sinks at this job's running sums (None before the
        first contribution; a sum this job does not own is copied first)."""
        opened = []
        ids = {id(p): j for j, p in enumerate(self.params)}
        for param, sink in self.blocks[b].sinks:
            j = ids.get(id(param))
            if j is None:
                continue
            acc = grad_p[j]
            if acc is not None and j not in self.owned:
                acc = grad_p[j] = acc.clone()
                self.owned.add(j)
            sink.target, sink.active = acc, True
            opened.append((j, sink))
        return opened

    def _search_params(self, b: int, roots: list[Tensor], own: Sequence[Any]) -> None:
        """Find the leaf tensors requiring grad in block ``b``'s taped graph that are not in
        its ``params``: another block's params (or ones given to the run) join its list; any
        other raises [`UnlistedParamsError`][spikeckpt.errors.UnlistedParamsError] naming the block."""
        self.searched.add(b)
        pidx = self.block_params[b]
        found = unseen_leaves(roots, [*own, *(self.params[j] for j in pidx)])
        if not found:
            return
        ids = {id(p): j for j, p in enumerate(self.params)}
        strangers = [t for t in found if id(t) not in ids]
        pidx.extend(ids[id(t)] for t in found if id(t) in ids)
        if strangers:
            raise unlisted_in_block(self.blocks[b].name, strangers, self.params)

    def _backward_block(
        self,
        c: int,
        b: int,
        g_out: list[Tensor | None],
        g_state: list[Tensor | None],
        grad_p: list[Tensor | None],
    ) -> tuple[list[Tensor | None], list[Tensor | None]]:
        """Recompute block ``b`` over chunk ``c``, backpropagate; returns the gradient w.r.t.
        its input chunk (as a one-element list) and w.r.t. its state at the chunk start."""
        assert self.x is not None
        t0, t1 = self.bounds[c]
        top = b == len(self.blocks) - 1
        train, stored_state = self._stored(c, b)
        inp = self._first_input(self.x, t0, t1) if b == 0 else train
        start = self.initial[b] if c == 0 else stored_state
        assert inp is not None and start is not None
        if all(g is None for g in (*g_out, *g_state)):
            return [None], [None] * len(start)
        want_in = b > 0 or self.need_x
        if self.direct:
            done = self._backward_untaped(c, b, inp, start, want_in, g_out, g_state, grad_p)
            if done is not None:
                self.stats.blocks[b].untaped_chunks += 1
                return done
        self._refuse_taped_gather(c, b)
        with torch.enable_grad():
            if isinstance(inp, Tensor):
                inp = inp.detach().requires_grad_(want_in and inp.is_floating_point())
            leaves = [
                t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in start
            ]
            saved = self.rng.get((c, b))
            if saved is not None:
                saved.restore()
            outs, final = self._run_block(c, b, inp, leaves, top)
            if b not in self.searched:
                self._search_params(b, [*outs, *final], [inp, *leaves])
            pidx = self.block_params[b]
            wrt = [inp, *leaves, *(self.params[j] for j in pidx)]
            got = self._gradients(b, [*outs, *final], [*g_out, *g_state], wrt, grad_p)
        self._accumulate(pidx, got[1 + len(leaves) :], grad_p)
        return [got[0] if want_in else None], list(got[1 : 1 + len(leaves)])

    def _refuse_taped_gather(self, c: int, b: int) -> None:
        """Raise where block ``b`` gathered over chunk ``c`` in the forward pass but must be
        taped now (its taped synapse would not compute the forward's values)."""
        if b > 0 and (c, b) in self.gathered:
            raise UsageError(
                f"layer-wise run: block {self.blocks[b].name!r} gathered over its input spikes "
                "in the forward pass and cannot run its backward untaped now (a hook added to "
                "its Linear, or autocast turned on, between forward and backward); run the "
                "forward again as the backward will run"
            )

    def _untaped_parts(self, b: int) -> UntapedParts | None:
        """What block ``b``'s untaped backward uses (`untaped_parts`), or None where it is
        taped; found once per run and block (the run's parameters are fixed)."""
        if b not in self.untaped_parts:
            block = self.blocks[b]
            kernel = self.kernels[b] if self.fuse and not block.draws_random else None
            mem_out = b == len(self.blocks) - 1 and self.output != "spikes"
            self.untaped_parts[b] = untaped_parts(kernel, block.affine, self.params, mem_out)
        return self.untaped_parts[b]

    def _backward_untaped(
        self,
        c: int,
        b: int,
        inp: Tensor | SparseChunk,
        start: list[Tensor],
        want_in: bool,
        g_out: list[Tensor | None],
        g_state: list[Tensor | None],
        grad_p: list[Tensor | None],
    ) -> tuple[list[Tensor | None], list[Tensor | None]] | None:
        """Block ``b``'s recomputation and backward over one chunk without autograd, where its
        synapse is an `AffineChunk` into a fused neuron (`spikeckpt.engine.direct`): the same
        values as the taped path, in place of its graph, its ``autograd.grad`` call and the
        float spikes it would hand back. None where it does not apply (the caller tapes)."""
        top = b == len(self.blocks) - 1
        found = self._untaped_parts(b)
        if found is None:
            return None
        kernel, affine, k_idx, a_idx = found
        mem_out = top and self.output != "spikes"
        spikes_out = not mem_out or self.output == "both"
        emit = self.blocks[b].emits if mem_out else None
        # the output gradients, handed over: freed once the neuron's backward has read them
        mems = g_out[int(spikes_out) :] if mem_out else [None]
        grads = [g_out[0] if spikes_out else None, tuple(mems) if emit else mems[-1], g_state]
        del mems
        g_out.clear()
        # the running sums this job owns are added into in place
        sums = [grad_p[j] if j is not None and j in self.owned else None for j in a_idx]
        sparse = self._sparse(c, b)
        with torch.no_grad():
            done = untaped_backward(kernel, affine, inp, start, sparse, want_in, grads, sums, emit)
        if done is None:  # declined before reading them: the taped path gets them back
            back = list(grads[1]) if emit else [grads[1]]  # type: ignore[arg-type]
            g_out.extend(cast(list[Tensor | None], [grads[0]] * spikes_out + back * mem_out))
            return None
        self.stats.forward_steps += done.steps
        self._accumulate(k_idx, done.kernel_grads, grad_p)  # type: ignore[arg-type]
        for j, own, g in zip(a_idx, sums, done.affine_grads, strict=True):
            if g is not None and own is None and j is not None:  # new (owned sums: added into)
                self._accumulate([j], [g], grad_p)
                self.owned.add(j)
        return [done.input_grad], done.state_grads

    def _gradients(
        self,
        b: int,
        outs: list[Tensor],
        out_grads: list[Tensor | None],
        wrt: list[Any],
        grad_p: list[Tensor | None],
    ) -> list[Tensor | None]:
        """The gradients of block ``b``'s recomputed ``outs`` (those with a gradient that
        require grad) w.r.t. ``wrt``, one per ``wrt`` (None where it needs none); the sums the
        block's synapse adds into directly (gradient sinks) land in ``grad_p``."""
        roots, root_grads = [], []
        for o, g in zip(outs, out_grads, strict=True):
            if g is not None and o.requires_grad:
                roots.append(o)
                root_grads.append(g)
        sinks = self._open_sinks(b, grad_p)
        mask = [isinstance(t, Tensor) and t.requires_grad for t in wrt]
        targets = [t for t, m in zip(wrt, mask, strict=True) if m]
        got: list[Tensor | None] = [None] * len(wrt)
        try:
            if roots and targets:
                it = iter(grad(roots, targets, root_grads))
                got = [next(it) if m else None for m in mask]
        finally:
            for j, sink in sinks:  # the sums the synapse added into (or started)
                if sink.target is not None:
                    grad_p[j] = sink.target
                    self.owned.add(j)
                sink.target, sink.active = None, False
        return got

    def _accumulate(
        self, pidx: list[int], found: Sequence[Tensor | None], grad_p: list[Tensor | None]
    ) -> None:
        """Add a block's parameter gradients ``found`` (for ``params[j]``, ``j`` in ``pidx``)
        into the running sums ``grad_p``."""
        for j, g in zip(pidx, found, strict=True):
            acc = grad_p[j]
            if g is None:
                continue
            if acc is None:
                grad_p[j] = g
            elif j in self.owned:  # a sum this job made: add in place (same values, no copy)
                acc.add_(g)
            else:
                grad_p[j] = acc + g
                self.owned.add(j)
