"""Benchmark ``spikeckpt.scan`` against the ways users save memory today (a script, not a test).

Network: 2 LIF layers (``inputs -> hidden -> hidden``, learnable decays, fast-sigmoid surrogate),
batch 32, 700 Bernoulli input channels at 5% density, output spikes summed over time.
Methods: plain BPTT loop; ``torch.utils.checkpoint`` per ``ceil(sqrt(T))``-step segment
(``use_reentrant=False``); ``torch.autograd.graph.save_on_cpu``; ``scan`` with Uniform
(``ceil(sqrt(T))``); classic single-step Revolve (``tape=1``, slots chosen to fit in the
checkpoint baseline's modeled memory); the memory-optimal Double (disk); and the planner's
fastest Revolve and Double (disk) within 3/4 of the checkpoint baseline's modeled memory
(``plans.rank`` with the step's measured forward, backward, disk copy and per-backward-call
times, :func:`spikeckpt.planning.step_costs`), so that a binomial or two-level schedule, not a
uniform one, is what fits (``--plan-budget`` sets another budget).
Peak bytes come from ``spikeckpt.MemoryMeter`` (one separate run: the meter slows ops down);
times are the median of ``--repeats`` unmetered iterations (forward + backward). Ratios are to
BPTT in the same run. ``max|dg|`` is the largest difference of any parameter gradient from
BPTT's (0 means bitwise equal).

    python benchmarks/bench_scan.py                 # T = 1000 and 4000
    python benchmarks/bench_scan.py --T 300 --repeats 1 --json out.json

``--layerwise``: the layer-wise granularity instead (issue 5's benchmark). Network: a 3-block
``700-512-512-20`` :class:`spikeckpt.models.LIFStack` as ``nn.Sequential(Linear, LIFNeuron,
...)``, batch 32, 5% input density, output spikes summed over time. Methods: the plain loop
(BPTT); ``spikeckpt.wrap(..., granularity="stack")`` with the memory-optimal ``Double`` plan
(``S``, ``A`` measured); ``granularity="layer"`` with chunks of ``ceil(sqrt(T))`` steps and of
``--chunk`` steps. Off-device tier: ``--storage`` (default ``disk``: on a CPU-only machine the
host RAM *is* the measured device, so the host tier saves nothing there).

    python benchmarks/bench_scan.py --layerwise --T 2000 8000
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import spikeckpt as sc
from spikeckpt import plans as P
from spikeckpt.engine.saved import measure_step
from spikeckpt.planning import step_costs


class Spike(torch.autograd.Function):
    """Heaviside forward, fast-sigmoid surrogate gradient."""

    @staticmethod
    def forward(ctx: Any, v: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(v)
        return (v > 0).to(v.dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:  # type: ignore[override]
        (v,) = ctx.saved_tensors
        return g / (1 + 10 * v.abs()) ** 2


class LIF2(nn.Module):
    """``step((v1, v2), x_t) -> ((v1, v2), z2_t)``; ``x_t`` is ``(B, inputs)``, ``v`` ``(B, H)``."""

    def __init__(self, n_in: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.d1 = nn.Parameter(torch.tensor(2.0))
        self.d2 = nn.Parameter(torch.tensor(2.0))
        with torch.no_grad():
            self.fc1.weight.mul_(4.0)
            self.fc2.weight.mul_(4.0)

    def forward(self, state: tuple[Tensor, Tensor], x: Tensor) -> tuple[Any, Tensor]:
        v1, v2 = state
        v1 = torch.sigmoid(self.d1) * v1 + self.fc1(x)
        z1 = Spike.apply(v1 - 1.0)
        v1 = v1 - z1
        v2 = torch.sigmoid(self.d2) * v2 + self.fc2(z1)
        z2 = Spike.apply(v2 - 1.0)
        v2 = v2 - z2
        return (v1, v2), z2


def _loss(count: Tensor) -> Tensor:
    """Spike counts ``(B, H)`` -> a scalar."""
    return (count / count.new_tensor(50.0) - 1.0).square().mean()


def _loop(net: LIF2, x: Tensor, state: Any, a: int, b: int) -> tuple[Any, Tensor]:
    count = None
    for t in range(a, b):
        state, z = net(state, x[t])
        count = z if count is None else count + z
    assert count is not None
    return state, count


def run_bptt(net: LIF2, x: Tensor, s0: Any) -> None:
    _, count = _loop(net, x, s0, 0, x.shape[0])
    _loss(count).backward()


def run_checkpoint(net: LIF2, x: Tensor, s0: Any) -> None:
    T = x.shape[0]
    k = math.isqrt(T - 1) + 1

    def segment(v1: Tensor, v2: Tensor, xs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        (v1, v2), count = _loop(net, xs, (v1, v2), 0, xs.shape[0])
        return v1, v2, count

    v1, v2 = s0
    total = None
    for a in range(0, T, k):
        v1, v2, count = checkpoint(segment, v1, v2, x[a : a + k], use_reentrant=False)
        total = count if total is None else total + count
    assert total is not None
    _loss(total).backward()


def run_save_on_cpu(net: LIF2, x: Tensor, s0: Any) -> None:
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        _, count = _loop(net, x, s0, 0, x.shape[0])
        loss = _loss(count)
    loss.backward()


def scan_runner(
    plan: Any, storage: str, directory: str | None = None, pack_tape: bool = True
) -> Callable[..., None]:
    def run(net: LIF2, x: Tensor, s0: Any) -> None:
        out = sc.scan(
            net, x, s0, plan=plan, storage=storage, readout="sum",
            directory=directory if storage == "disk" else None, pack_tape=pack_tape,
        )  # fmt: skip
        _loss(out.ys).backward()
        run.stats = out.stats  # type: ignore[attr-defined]

    return run


def _grads(net: nn.Module) -> list[Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]


def measure(fn: Callable[..., None], net: LIF2, x: Tensor, s0: Any, repeats: int) -> dict[str, Any]:
    """Peak bytes (one metered run), median time of ``repeats`` runs, and the gradients."""
    net.zero_grad(set_to_none=True)
    fn(net, x, s0)  # warm-up (and the gradients we compare)
    grads = _grads(net)
    net.zero_grad(set_to_none=True)
    with sc.MemoryMeter() as meter:
        fn(net, x, s0)
    times = []
    for _ in range(repeats):
        net.zero_grad(set_to_none=True)
        start = time.perf_counter()
        fn(net, x, s0)
        times.append(time.perf_counter() - start)
    stats = getattr(fn, "stats", None)
    return {
        "peak_bytes": meter.peak_bytes,
        "time_s": statistics.median(times),
        "grads": grads,
        "evals_per_step": stats.recompute_factor if stats is not None else None,
        "plan": stats.plan if stats is not None else None,
    }


def planned(
    T: int, S: int, A: int, budget: int, costs: P.CostModel, family: type[P.Plan]
) -> P.Plan:
    """The planner's best member of ``family`` within ``budget`` bytes (``plans.rank``)."""
    ranked = P.rank(T, S, A, budget, remote=family is P.Double, costs=costs)
    found = next((c.plan for c in ranked if isinstance(c.plan, family)), None)
    if found is None:
        raise SystemExit(f"no {family.__name__} plan fits {budget} bytes at T={T}")
    return found


def bench(T: int, args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    net = LIF2(args.inputs, args.hidden)
    x = (torch.rand(T, args.batch, args.inputs) < args.density).float()
    s0 = (torch.zeros(args.batch, args.hidden), torch.zeros(args.batch, args.hidden))
    pack = args.pack_tape == "on"
    params = list(net.parameters())
    probe = measure_step(net, s0, x[0], params, pack=pack)
    S, A = probe.state_bytes, probe.step_bytes
    k = math.isqrt(T - 1) + 1
    ckpt_bytes = math.ceil(T / k) * S + k * A  # checkpoint baseline, modeled
    slots = max(1, min(T, (ckpt_bytes - A) // S - 1))
    costs = step_costs(net, s0, x, params, "disk")  # measured seconds, for the planned rows
    budget = sc.parse_bytes(args.plan_budget) if args.plan_budget else ckpt_bytes * 3 // 4
    revolve = planned(T, S, A, budget, costs, P.Revolve)
    double = planned(T, S, A, budget, costs, P.Double)
    methods: list[tuple[str, Callable[..., None]]] = [
        ("BPTT loop", run_bptt),
        ("torch checkpoint sqrt(T)", run_checkpoint),
        ("save_on_cpu", run_save_on_cpu),
        ("scan Uniform", scan_runner(P.Uniform(), "host", pack_tape=pack)),
        ("scan Revolve tape=1", scan_runner(P.Revolve(slots), "host", pack_tape=pack)),
        ("scan Revolve planned", scan_runner(revolve, "host", pack_tape=pack)),
        (
            "scan Double disk min-mem",
            scan_runner(P.Double(state_bytes=S, step_bytes=A), "disk", folder, pack_tape=pack),
        ),
        ("scan Double disk planned", scan_runner(double, "disk", folder, pack_tape=pack)),
    ]
    f = costs.forward
    print(
        f"T={T}: S={S} B, A={A} B; costs in forward steps: backward {costs.backward / f:.2f}, "
        f"write {costs.write / f:.2f}, read {costs.read / f:.2f}, "
        f"per backward call {costs.segment / f:.2f}; "
        f"planned within {budget / 2**20:.1f} MiB: {revolve!r}, {double!r}"
    )
    fields = {"T": T, "S": S, "A": A, "segment_steps": costs.segment / f}
    return run_methods(methods, net, x, s0, args, fields)


def run_methods(
    methods: list[tuple[str, Callable[..., None]]],
    net: nn.Module,
    x: Tensor,
    s0: Any,
    args: argparse.Namespace,
    fields: dict[str, Any],
    second: str | None = None,
) -> list[dict[str, Any]]:
    """Measure each method (those ``--only`` keeps); add ratios to the BPTT loop's row and,
    with ``second``, to the first row whose method starts with it (``*_vs_double``)."""
    rows: list[dict[str, Any]] = []
    for name, fn in methods:
        if args.only and not any(o.lower() in name.lower() for o in args.only):
            continue
        result = measure(fn, net, x, s0, args.repeats)  # type: ignore[arg-type]
        rows.append({**fields, "method": name, **result})
        print(
            f"  T={fields['T']} {name}: {result['peak_bytes'] / 2**20:.1f} MiB, "
            f"{result['time_s']:.2f} s"
        )
    base = next((r for r in rows if r["method"] == "BPTT loop"), rows[0])
    other = next((r for r in rows if second and r["method"].startswith(second)), None)
    for row in rows:
        row["peak_ratio"] = row["peak_bytes"] / base["peak_bytes"]
        row["time_ratio"] = row["time_s"] / base["time_s"]
        if other is not None:
            row["peak_vs_double"] = row["peak_bytes"] / other["peak_bytes"]
            row["time_vs_double"] = row["time_s"] / other["time_s"]
        row["max_grad_diff"] = max(
            (g - b).abs().max().item() for g, b in zip(row["grads"], base["grads"], strict=True)
        )
    for row in rows:
        del row["grads"]
    return rows


def _wrapped_runner(seq: nn.Module, **wrap_kwargs: Any) -> Callable[..., None]:
    """A runner for ``spikeckpt.wrap(seq, readout="sum", **wrap_kwargs)``."""

    def run(net: nn.Module, x: Tensor, s0: Any) -> None:
        wrapped = sc.wrap(seq, readout="sum", **wrap_kwargs)
        try:
            _loss(wrapped(x)).backward()
            stats = wrapped.last_stats
            run.stats = _LayerStats(stats) if stats is not None else None  # type: ignore[attr-defined]
        finally:
            sc.unwrap(wrapped)

    return run


class _LayerStats:
    """The two fields :func:`measure` reads, from a ``ScanStats`` or ``LayerwiseStats``."""

    def __init__(self, stats: Any) -> None:
        if hasattr(stats, "recompute_factor"):  # ScanStats (stack granularity)
            self.recompute_factor, self.plan = stats.recompute_factor, str(stats.plan)
        else:  # LayerwiseStats: neuron steps per block and time step
            self.recompute_factor = stats.forward_steps / (stats.T * len(stats.blocks))
            self.plan = f"layer-wise chunk {stats.chunk}"


def bench_layerwise(T: int, args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    """Issue 5's comparison: BPTT loop, stack-mode Double and layer-wise on one network."""
    from spikeckpt.models import LIFStack

    torch.manual_seed(0)
    model = LIFStack([args.inputs, *([args.hidden] * (args.blocks - 1)), args.outputs])
    with torch.no_grad():
        for synapse in model.synapses:
            synapse.weight.mul_(4.0)
    seq = model.as_sequential()
    x = (torch.rand(T, args.batch, args.inputs) < args.density).float()
    s0 = model.initial_state(args.batch)
    probe = measure_step(model.step, s0, x[0], list(model.parameters()), pack=True)
    S, A = probe.state_bytes, probe.step_bytes
    storage = args.storage
    directory = {"directory": folder} if storage == "disk" else {}

    def run_loop(net: nn.Module, x: Tensor, s0: Any) -> None:
        _, count = _loop(model.step, x, s0, 0, x.shape[0])  # type: ignore[arg-type]
        _loss(count).backward()

    sqrt_chunk = math.isqrt(T - 1) + 1
    chunks = dict.fromkeys([sqrt_chunk, min(args.chunk, T)])
    methods: list[tuple[str, Callable[..., None]]] = [
        ("BPTT loop", run_loop),
        (
            f"stack Double {storage}",
            _wrapped_runner(
                seq,
                plan=P.Double(state_bytes=S, step_bytes=A),
                storage=storage,
                **directory,
            ),
        ),
    ]
    for k in chunks:
        methods.append(
            (
                f"layer-wise {storage} k={k}",
                _wrapped_runner(
                    seq, plan=P.Uniform(k), storage=storage, granularity="layer", **directory
                ),
            )
        )
    return run_methods(methods, model, x, s0, args, {"T": T, "S": S, "A": A}, second="stack Double")


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'T':>5} | {'method':<24} | {'plan':<28} | {'peak MiB':>9} | {'peak/BPTT':>9} | "
        f"{'time s':>7} | {'time/BPTT':>9} | {'evals/T':>7} | {'max|dg|':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        evals = f"{r['evals_per_step']:.2f}" if r["evals_per_step"] is not None else "-"
        lines.append(
            f"{r['T']:>5} | {r['method']:<24} | {(r['plan'] or '-')[:28]:<28} | "
            f"{r['peak_bytes'] / 2**20:>9.1f} | {r['peak_ratio']:>9.4f} | {r['time_s']:>7.2f} | "
            f"{r['time_ratio']:>9.2f} | {evals:>7} | {r['max_grad_diff']:>8.1e}"
            + (
                f" | {r['peak_vs_double']:>9.4f} | {r['time_vs_double']:>9.2f}"
                if "peak_vs_double" in r
                else ""
            )
        )
    if any("peak_vs_double" in r for r in rows):
        lines[0] += f" | {'peak/Dbl':>9} | {'time/Dbl':>9}"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--hidden", type=int, default=None, help="hidden width (default 256; --layerwise 512)"
    )
    parser.add_argument("--inputs", type=int, default=700)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of method names")
    parser.add_argument(
        "--pack-tape", choices=["on", "off"], default="off", help="scan(..., pack_tape=...)"
    )
    parser.add_argument(
        "--plan-budget",
        default=None,
        help="modeled budget of the planned rows, e.g. 6MiB (default: 3/4 of checkpoint's)",
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--layerwise", action="store_true", help="BPTT vs stack Double vs layer-wise (issue 5)"
    )
    parser.add_argument("--blocks", type=int, default=3, help="--layerwise: LIF blocks")
    parser.add_argument("--outputs", type=int, default=20, help="--layerwise: output neurons")
    parser.add_argument("--chunk", type=int, default=200, help="--layerwise: a second chunk")
    parser.add_argument(
        "--storage", choices=["host", "disk"], default="disk", help="--layerwise: tier"
    )
    args = parser.parse_args(argv)
    if args.hidden is None:
        args.hidden = 512 if args.layerwise else 256
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-scan-") as folder:
        for T in args.T:
            rows += (bench_layerwise if args.layerwise else bench)(T, args, folder)
    print(table(rows))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
