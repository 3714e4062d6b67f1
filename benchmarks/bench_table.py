"""Issue 18's table: spikeckpt near the recompute floor, against the loops users write today.

One process, CPU, one torch thread by default. Network: a feed-forward LIF stack (default
``200-256-10``), batch 16, input spikes at 5% density (the input train is made before and not
counted), loss on the output firing rate (spikes averaged over time, reduced inside the loop).
Every row runs **one training step** (forward over ``T`` steps, loss, backward into ``.grad``).

Rows:

- ``plain loop``: :class:`spikeckpt.models.LIFStack` stepped in a Python loop (plain BPTT);
  every ratio of the table is to this row.
- ``snnTorch loop``: the same widths and weights as ``nn.Sequential(Linear, snn.Leaky, ...)``,
  stepped the way snnTorch's tutorials do (``spk, mem = lif(cur, mem)``), plain BPTT.
- ``torch.utils.checkpoint per sqrt(T)``: the plain loop with ``checkpoint`` around each
  ``ceil(sqrt(T))``-step segment (``use_reentrant=False``).
- ``planner, budget = checkpoint's peak, host``: ``spikeckpt.scan(model.step, ...,
  plan="auto", budget=<the checkpoint row's measured peak + the dense input's bytes>,
  storage="host")`` (a budget counts the whole step, the input on the device included; the
  peaks here leave it out, so the budgets add it, to compare like with like).
- ``planner, budget = 5% of BPTT, disk``: the same with 5% of the plain loop's measured peak,
  ``storage="disk"`` (on a CPU-only machine host RAM is the measured memory: only the disk
  tier takes checkpoints out of it).
- ``layer-wise, 5%, disk``: ``spikeckpt.wrap(<the snnTorch model>, plan="auto",
  budget=<5% of the snnTorch loop's peak + the dense input's bytes>, granularity="layer",
  storage="disk")`` (wrap's budget counts the input on the device; the peaks here do not); its time
  is also given relative to the snnTorch loop (the loop it replaces).
- ``SpikingJelly memopt`` (only when ``import spikingjelly`` works): SpikingJelly's own LIF
  network with its memory optimisation, against SpikingJelly's own BPTT loop.
- with ``--chunks K ...``: ``layer-wise, chunk K, disk``, the same wrapped snnTorch model at a
  fixed chunk of ``K`` steps (no budget), against the snnTorch loop.
- with ``--more``: ``scan`` with ``Double()`` (disk), ``Uniform()`` (host) and
  ``TwoLevel(4)`` (disk) built without intervals (filled in from measured sizes and costs).
- with ``--fused``: ``layer-wise, 5%, disk, per-step neuron`` / ``..., fused, eager`` /
  ``..., fused, compiled``: the layer-wise row with ``fuse=False``, or ``fuse=True`` and
  ``compile=False`` / ``True`` (the rows above take ``wrap``'s defaults), only when
  ``spikeckpt.wrap`` has those keywords (issue 24), else listed as skipped. The plan column
  says how each block's neuron ran (``last_stats.blocks[i].neuron``).

Device: ``--device cpu`` (default) or ``cuda`` (models, input and states on the GPU; times
synchronised). Memory: :class:`spikeckpt.MemoryMeter` peak of one separate training step
(after an untimed first one, which plans, probes and compiles), ``mode="allocator"`` by
default (CUDA: the allocator's peak; CPU: the allocator's events through the profiler, so
that compiled rows run compiled while measured); ``--meter tensors`` for the tensor tracker
that measured the tables before issue 24 (it slows ops down; agrees within about 2% on eager
rows, and runs compiled code eagerly). Time: every row runs once per round, rounds
interleaved, ``--repeats`` rounds; the time is the **minimum** over the rounds. Before each
timed run ``gc.collect()`` runs (untimed), and the snnTorch loop detaches the membrane
snnTorch keeps on each neuron after its backward: otherwise the garbage of one row (that
loop's whole graph, held by ``self.mem``) was collected during the next row's run, about 0.1x
of BPTT added to the scan rows. ``max|dg|/max|g|``: the largest gradient difference to the
row's loop (the plain loop; the snnTorch loop for layer-wise), relative to that loop's
largest gradient of the same parameter.

    python benchmarks/bench_table.py                    # T = 1000 and 4000
    python benchmarks/bench_table.py --T 1000 --widths 200 256 256 256 --repeats 3
    python benchmarks/bench_table.py --T 1000 --widths 700 512 512 20 --batch 32
    python benchmarks/bench_table.py --device cuda --fused    # the GPU suite's table
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import spikeckpt as sc
from spikeckpt import plans as P
from spikeckpt.models import LIFStack, spike_train


def rate_loss(total: Tensor, T: int) -> Tensor:
    """Loss of the summed output spikes ``(B, N)`` over ``T`` steps."""
    return (total / T - 0.1).square().mean()


# ----------------------------------------------------------------------------- networks


def lif_stack(widths: list[int], seed: int = 0) -> LIFStack:
    torch.manual_seed(seed)
    model = LIFStack(widths)
    with torch.no_grad():  # strong enough weights that every layer spikes
        for synapse in model.synapses:
            synapse.weight.mul_(4.0)
    return model


def snntorch_model(model: LIFStack) -> nn.Sequential | None:
    """``nn.Sequential(Linear, snn.Leaky, ...)`` with ``model``'s weights (None: no snnTorch)."""
    try:
        import snntorch as snn
    except ImportError:
        return None
    layers: list[nn.Module] = []
    for synapse in model.synapses:
        linear = nn.Linear(synapse.in_features, synapse.out_features)
        with torch.no_grad():
            linear.weight.copy_(synapse.weight)
            linear.bias.copy_(synapse.bias)
        layers += [linear, snn.Leaky(beta=0.9)]
    return nn.Sequential(*layers)


def _lif_loop(model: LIFStack, x: Tensor, state: Any) -> tuple[Any, Tensor]:
    total = None
    step = model.step
    for x_t in x:
        state, y = step(state, x_t)
        total = y if total is None else total + y
    assert total is not None
    return state, total


def run_plain(model: LIFStack, x: Tensor) -> None:
    _, total = _lif_loop(model, x, model.initial_state(x.shape[1]))
    rate_loss(total, x.shape[0]).backward()


def run_snntorch(seq: nn.Sequential, x: Tensor) -> None:
    layers = list(seq)
    linears, neurons = layers[0::2], layers[1::2]
    mems = [torch.zeros(x.shape[1], lin.out_features, device=x.device) for lin in linears]
    total = None
    for x_t in x:
        h = x_t
        for i, (lin, lif) in enumerate(zip(linears, neurons, strict=True)):
            h, mems[i] = lif(lin(h), mems[i])
        total = h if total is None else total + h
    assert total is not None
    rate_loss(total, x.shape[0]).backward()
    # snnTorch keeps the last membrane, and through it the whole loop's graph, on each neuron
    # (``self.mem``); left there, that graph is freed later, in whatever row runs next
    for lif in neurons:
        if isinstance(getattr(lif, "mem", None), Tensor):
            lif.mem = lif.mem.detach()


def run_checkpoint(model: LIFStack, x: Tensor) -> None:
    T = x.shape[0]
    k = math.isqrt(T - 1) + 1

    def segment(xs: Tensor, *leaves: Tensor) -> tuple[Tensor, ...]:
        state = tuple((leaves[i], leaves[i + 1]) for i in range(0, len(leaves), 2))
        state, total = _lif_loop(model, xs, state)
        return (*(t for layer in state for t in layer), total)

    leaves = [t for layer in model.initial_state(x.shape[1]) for t in layer]
    total = None
    for a in range(0, T, k):
        *leaves, part = checkpoint(segment, x[a : a + k], *leaves, use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None
    rate_loss(total, T).backward()


def scan_runner(plan: Any, storage: str, budget: int | None, folder: str) -> Callable[..., Any]:
    def run(model: LIFStack, x: Tensor) -> Any:
        out = sc.scan(
            model.step,
            x,
            model.initial_state(x.shape[1]),
            plan=plan,
            budget=budget,
            storage=storage,  # type: ignore[arg-type]
            readout="mean",
            params=list(model.parameters()),
            directory=folder if storage == "disk" else None,
        )
        (out.ys - 0.1).square().mean().backward()
        return out.stats

    return run


WRAP_KEYWORDS = set(inspect.signature(sc.wrap).parameters)


def layerwise_runner(
    seq: nn.Module,
    budget: int | None,
    storage: str,
    folder: str,
    chunk: int | None = None,
    **options: Any,
) -> Callable[..., Any]:
    """``wrap(seq, granularity="layer")`` with ``budget`` (``plan="auto"``) or a fixed
    ``chunk``; ``options`` (``fuse``, ``compile``) are passed on."""
    kwargs: dict[str, Any] = {"directory": folder} if storage == "disk" else {}
    if budget is not None:
        kwargs.update(plan="auto", budget=budget)
    wrapped = sc.wrap(
        seq, storage=storage, readout="mean", granularity="layer", chunk=chunk, **kwargs, **options
    )

    def run(model: nn.Module, x: Tensor) -> Any:
        rate = wrapped(x)
        (rate - 0.1).square().mean().backward()
        return wrapped.last_stats

    return run


def spikingjelly_rows(
    widths: list[int], x: Tensor
) -> dict[str, tuple[nn.Module, Callable[..., Any]]]:
    """SpikingJelly's own BPTT loop and its memopt (layer-wise gradient checkpointing with
    spike compression, ``memopt.memory_optimization(..., level=1)``) on the same widths, or
    nothing when SpikingJelly is not installed (never faked). Untested here: not installed."""
    try:
        from spikingjelly.activation_based import functional, layer, memopt, neuron
    except ImportError:
        return {}

    class Block(nn.Module):
        def __init__(self, a: int, b: int) -> None:
            super().__init__()
            self.fc = layer.Linear(a, b, step_mode="m")
            self.lif = neuron.LIFNode(tau=10.0, detach_reset=True, step_mode="m")

        def forward(self, h: Tensor) -> Tensor:
            return self.lif(self.fc(h))

        def __spatial_split__(self) -> tuple[nn.Module, nn.Module]:
            return self.fc, self.lif

    def build() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(*(Block(a, b) for a, b in zip(widths[:-1], widths[1:], strict=True)))
        functional.set_step_mode(net, "m")
        return net.to(x.device)

    def run_sj(model: nn.Module, x: Tensor) -> None:
        functional.reset_net(model)
        rate_loss(model(x).sum(0), x.shape[0]).backward()

    rows: dict[str, tuple[nn.Module, Callable[..., Any]]] = {"SpikingJelly BPTT": (build(), run_sj)}
    try:
        optimised = memopt.memory_optimization(
            build(), (Block,), dummy_input=(x,), compress_x=True, level=1
        )
        rows["SpikingJelly memopt"] = (optimised, run_sj)
    except Exception as error:  # noqa: BLE001 - an optional peer: report, never fail
        print(f"SpikingJelly memopt unavailable: {error}")
    return rows


# ----------------------------------------------------------------------------- measuring


@dataclass
class Row:
    name: str
    model: nn.Module
    run: Callable[[nn.Module, Tensor], Any]
    base: str = "plain loop"  # the row whose gradients it must equal
    peak: int = 0
    times: list[float] = field(default_factory=list)
    plan: str = "-"
    evals: float | None = None
    grad_rel: float | None = None
    grads: list[Tensor] | None = None

    @property
    def time(self) -> float:
        return min(self.times)


def _grads(model: nn.Module) -> list[Tensor]:
    return [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(row: Row, x: Tensor) -> Any:
    row.model.zero_grad(set_to_none=True)
    return row.run(row.model, x)


def _describe(stats: Any) -> tuple[str, float | None]:
    if stats is None:
        return "-", None
    if getattr(stats, "granularity", "stack") == "layer":
        ways = sorted({str(getattr(block, "neuron", "")) for block in stats.blocks} - {""})
        neuron = f", neuron {'/'.join(ways)}" if ways else ""
        return f"layer-wise(chunk={stats.chunk}){neuron}", stats.forward_steps / (
            stats.T * len(stats.blocks)
        )
    return str(stats.plan), stats.recompute_factor


METER_MODE = "allocator"  # --meter


def measure_memory(row: Row, x: Tensor) -> None:
    row.model.zero_grad(set_to_none=True)
    _once(row, x)  # untimed first call: compilation and planning are not measured
    row.model.zero_grad(set_to_none=True)
    gc.collect()
    _sync(x.device)
    with sc.MemoryMeter(x.device, mode=METER_MODE) as meter:
        stats = row.run(row.model, x)
        _sync(x.device)
    row.peak = meter.peak_bytes
    row.plan, row.evals = _describe(stats)
    row.grads = _grads(row.model)


def rel_diff(grads: list[Tensor], ref: list[Tensor]) -> float:
    worst = 0.0
    for g, r in zip(grads, ref, strict=True):
        scale = float(r.abs().max()) or 1.0
        worst = max(worst, float((g - r).abs().max()) / scale)
    return worst


def bench(T: int, args: argparse.Namespace, folder: str) -> list[Row]:
    widths = args.widths
    device = torch.device(args.device)
    model = lif_stack(widths).to(device)
    snn_model = snntorch_model(model)
    if snn_model is not None:
        snn_model = snn_model.to(device)
    x = spike_train(T, args.batch, widths[0], args.density, seed=1).to(device)
    rows: dict[str, Row] = {}

    def add(row: Row) -> None:
        if args.only and row.name != "plain loop" and not any(o in row.name for o in args.only):
            return
        if row.name != "plain loop" and any(word in row.name for word in args.skip):
            return
        try:
            measure_memory(row, x)
        except sc.BudgetTooSmall as error:  # a budget row refused at this size: say so, go on
            print(f"  T={T} {row.name}: skipped (BudgetTooSmall: {error})", flush=True)
            return
        rows[row.name] = row
        print(
            f"  T={T} {row.name}: {row.plan}, peak {row.peak / 2**20:.2f} MiB",
            flush=True,
        )

    add(Row("plain loop", model, run_plain))
    plain_peak = rows["plain loop"].peak
    snn_peak = None
    if snn_model is not None:
        add(Row("snnTorch loop", snn_model, run_snntorch, base="snnTorch loop"))
        snn_peak = rows["snnTorch loop"].peak if "snnTorch loop" in rows else None
    add(Row("torch.utils.checkpoint per sqrt(T)", model, run_checkpoint))
    ckpt = rows.get("torch.utils.checkpoint per sqrt(T)")
    if ckpt is None:  # --only without it: measure its peak anyway, for the budget
        probe = Row("checkpoint", model, run_checkpoint)
        measure_memory(probe, x)
        ckpt_peak = probe.peak
    else:
        ckpt_peak = ckpt.peak
    share = args.share
    # a budget counts the whole step, the dense input train on the device included; the rows'
    # peaks leave it out (made before the step): the budgets add it, to compare like with like
    x_bytes = x.numel() * x.element_size()
    add(
        Row(
            "planner, budget = checkpoint's peak, host",
            model,
            scan_runner("auto", "host", ckpt_peak + x_bytes, folder),
        )
    )
    add(
        Row(
            f"planner, budget = {share:g}% of BPTT, disk",
            model,
            scan_runner("auto", "disk", int(plain_peak * share / 100) + x_bytes, folder),
        )
    )
    if snn_model is not None and snn_peak is not None:
        budget = int(snn_peak * share / 100) + x_bytes
        add(
            Row(
                f"layer-wise, {share:g}%, disk",
                snn_model,
                layerwise_runner(snn_model, budget, "disk", folder),
                base="snnTorch loop",
            )
        )
        for chunk in args.chunks:
            add(
                Row(
                    f"layer-wise, chunk {chunk}, disk",
                    snn_model,
                    layerwise_runner(snn_model, None, "disk", folder, chunk),
                    base="snnTorch loop",
                )
            )
        if args.fused:
            fused: list[tuple[str, dict[str, Any]]] = [
                (f"layer-wise, {share:g}%, disk, per-step neuron", {"fuse": False}),
                (f"layer-wise, {share:g}%, disk, fused, eager", {"fuse": True, "compile": False}),
                (f"layer-wise, {share:g}%, disk, fused, compiled", {"fuse": True, "compile": True}),
            ]
            for name, options in fused:
                missing = [key for key in options if key not in WRAP_KEYWORDS]
                if missing:
                    print(f"  T={T} {name}: skipped (spikeckpt.wrap has no {missing} yet)")
                    continue
                runner = layerwise_runner(snn_model, budget, "disk", folder, **options)
                add(Row(name, snn_model, runner, base="snnTorch loop"))
    if args.more:
        add(Row("scan Double(), disk", model, scan_runner(P.Double(), "disk", None, folder)))
        add(Row("scan Uniform(), host", model, scan_runner(P.Uniform(), "host", None, folder)))
        add(Row("scan TwoLevel(4), disk", model, scan_runner(P.TwoLevel(4), "disk", None, folder)))
    for name, (net, run) in spikingjelly_rows(widths, x).items():
        add(Row(name, net, run, base="SpikingJelly BPTT"))
    for row in rows.values():
        base = rows.get(row.base)
        if base is not None and base.grads is not None and row.grads is not None:
            row.grad_rel = rel_diff(row.grads, base.grads)
    for _ in range(args.repeats):  # interleaved rounds; each row's time is its minimum
        for row in rows.values():
            gc.collect()  # no row pays for collecting another row's garbage
            _sync(device)
            start = time.perf_counter()
            _once(row, x)
            _sync(device)
            row.times.append(time.perf_counter() - start)
    return list(rows.values())


def table(T: int, rows: list[Row], share: float) -> str:
    by = {r.name: r for r in rows}
    plain = by["plain loop"]
    lines = [
        "| T | row | plan | peak | x less than BPTT | time / BPTT | evals/step | max|dg|/max|g| |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r.time / plain.time
        text = f"{ratio:.2f}"
        if r.name == "plain loop":
            text = f"1.00 ({plain.time:.2f} s)"
        elif r.base != "plain loop" and r.base in by and r.base != r.name:
            text += f" = {r.time / by[r.base].time:.2f}x the {r.base}"
        evals = f"{r.evals:.2f}" if r.evals is not None else "-"
        dg = f"{r.grad_rel:.1e}" if r.grad_rel is not None and r.name != r.base else "-"
        lines.append(
            f"| {T} | {r.name} | {r.plan} | {r.peak / 2**20:.2f} MiB | "
            f"{plain.peak / max(r.peak, 1):.1f} | {text} | {evals} | {dg} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--widths", type=int, nargs="+", default=[200, 256, 10])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--share", type=float, default=5.0, help="budget share of BPTT, percent")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (min)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of row names")
    parser.add_argument(
        "--skip", nargs="*", default=[], help="leave out rows whose names contain these"
    )
    parser.add_argument("--more", action="store_true", help="also Double(), Uniform(), TwoLevel")
    parser.add_argument(
        "--chunks", type=int, nargs="*", default=[], help="also layer-wise at these fixed chunks"
    )
    parser.add_argument(
        "--fused", action="store_true", help="also layer-wise fused/compiled (issue 24's wrap)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--meter",
        choices=["allocator", "tensors"],
        default="allocator",
        help="MemoryMeter mode for the peaks",
    )
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    global METER_MODE
    METER_MODE = args.meter
    torch.set_num_threads(args.threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    print(
        f"{datetime.date.today()}, {platform.machine()} {platform.processor() or ''} "
        f"({os.cpu_count()} cores), torch {torch.__version__}, {torch.get_num_threads()} "
        f"thread(s), load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; widths "
        f"{'-'.join(map(str, args.widths))}, batch {args.batch}, density {args.density}; "
        f"device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
        + f"; peaks: MemoryMeter(mode={args.meter!r})"
    )
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-table-") as folder:
        for T in args.T:
            rows = bench(T, args, folder)
            print(table(T, rows, args.share), flush=True)
            out += [
                {
                    "T": T,
                    "row": r.name,
                    "plan": r.plan,
                    "peak_bytes": r.peak,
                    "times_s": r.times,
                    "evals_per_step": r.evals,
                    "grad_rel": r.grad_rel,
                }
                for r in rows
            ]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    print(f"load at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
