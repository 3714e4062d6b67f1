"""The peers' benchmark: one ``Linear(n, n)`` + one LIF layer, as the Open Neuromorphic one.

Our own code, following the Open Neuromorphic SNN library benchmark (Lenz et al., "SNN library
benchmarks", open-neuromorphic.org, 2023): one fully connected layer and one layer of leaky
integrate-and-fire neurons, batch 16, ``T = 500`` steps, ``n`` in {512, 2048, 8192}, one
forward and one backward pass. Here the input is random spikes (5% density by default, made
once before the rows run and never counted), the ``Linear`` weights are the default init times
``--gain`` (4: about 6% output spikes with snnTorch's neuron) and every row's loss is the same
function of its output spikes: ``(spikes summed over time * w).sum()`` with a fixed random
``w`` of shape ``(n,)``.

Rows (each library's model as its users write it; skipped rows are listed with the reason):

- ``snnTorch loop``: ``nn.Linear`` + ``snn.Leaky(beta=0.95)`` (default atan surrogate, subtract
  reset), stepped in a Python loop as snnTorch's tutorials do (``spk, mem = lif(fc(x[t]),
  mem)``, spikes appended and ``torch.stack``\\ ed). Every ratio of the table is to this row,
  and every spikeckpt row wraps this very model (same parameters).
- ``Norse SequentialState(Linear, LIF), eager``: ``norse.torch.SequentialState(nn.Linear, LIF())``
  on the whole ``(T, B, n)`` input (Norse's own time loop).
- ``Norse LIFCell, torch.compile, stepped``: ``torch.compile(LIFCell())`` called once per step
  in a Python loop after the ``Linear``.
- ``SpikingJelly LIFNode multi-step, torch``: ``layer.Linear`` + ``neuron.LIFNode(tau=20,
  decay_input=False, v_reset=None, surrogate ATan, step_mode="m")``, as close to snnTorch's
  ``Leaky(beta=0.95)`` as its options go (leak ``1 - 1/tau = 0.95``, input not decayed,
  subtract reset; the reset is not scaled by the leak there, so its gradient is not the
  loop's) (``backend="torch"`` where the installed version has that
  argument; SpikingJelly 2.0 has none: its multi-step LIF is a registered op whose CPU code,
  and on CUDA with ``SJ_LIF_CUDA_IMPLEMENTATION=torch`` (set here unless set already), is a
  torch loop with a hand-written backward). Only when ``import spikingjelly`` works: install it
  by hand (``pip install spikingjelly``); it is not a project dependency, since it pulls a
  torchaudio built for another torch release into the environment.
- ``spikeckpt stack, BPTT()``: ``spikeckpt.wrap(<the snnTorch model>, plan=BPTT(),
  readout="sum")``; ``..., dense input``: the same given the dense ``x`` the loop rows get
  (what the packed train's per-step unpack costs is the difference).
- ``spikeckpt stack, plan=auto at S%``: ``wrap(..., plan="auto", budget=B)``, ``B`` = ``S``%
  of the snnTorch loop's measured peak plus the packed input's bytes (wrap's budget counts the
  input it is given; the rows' peaks do not). ``--share``: one percentage per ``--n`` (the last
  one repeats), default 10 and 20 (issue 24's goals: 1/10 of the loop's peak at n = 512, 1/5
  at n = 2048).
- ``spikeckpt auto at S%``: the same budget with ``granularity="auto"``: the planner picks stack
  or layer-wise, and the plan, by itself.
- ``spikeckpt layer-wise, chunk K, per-step neuron``: ``wrap(..., granularity="layer",
  chunk=K)`` (``--chunk``, default 25), the neuron called once per step (``fuse=False`` and
  ``compile=False`` are passed when ``wrap`` has those keywords).
- ``spikeckpt layer-wise, chunk K, fused, eager`` / ``..., fused, compiled``: the same with the
  neuron fused over each chunk (``fuse=True``), run eagerly (``compile=False``) or compiled
  (``compile=True``). These rows run only when ``spikeckpt.wrap`` has the ``fuse`` /
  ``compile`` keywords (issue 24); otherwise they are listed as skipped. The plan column says
  how each block's neuron ran (``last_stats.blocks[i].neuron``: fused, compiled, per-step).
- ``spikeckpt layer-wise, chunk K, fused, exact``: the fused eager row with ``exact=True``
  (every synapse step by step, as the loop runs it: spikes bitwise the loop's on any device).

Every spikeckpt row gets the input as a user who wants the lean peak passes it: packed,
``spikeckpt.SpikeTrain.from_dense(x)`` (made once, before, not counted).

Measured per row, in one process: **first call** (seconds of the row's first forward +
backward: compilation, planning and probing included), **time** (minimum over ``--repeats``
interleaved rounds after ``--warmup`` untimed rounds; ``gc.collect()`` before each run,
untimed; CUDA synchronised), **peak** (one separate forward + backward under
``spikeckpt.MemoryMeter(device, mode="allocator")``: on CUDA the caching allocator's peak, on
the CPU the allocator's own allocation events through the profiler, so compiled rows run
compiled while measured and gradients accumulate as in a plain run; bytes above the level at
entry, parameters and input excluded, ``.grad`` included), **out rate** (output spikes per
neuron and step) and **max rel dW**: ``max|dW - dW_loop| / max|dW_loop|`` on the ``Linear``
weight, against the snnTorch loop (``n/a``: another neuron model, Norse's or SpikingJelly's own
LIF, whose gradient is not the loop's). A budget row whose peak is over its budget (less the
packed input, which the peak leaves out) says so in its plan column, and the script then
exits 1.

    python benchmarks/bench_peers.py --threads 1                 # n = 512 and 2048, CPU
    python benchmarks/bench_peers.py --n 8192 --device cuda --out peers-cuda.md
    python benchmarks/bench_peers.py --n 32 --T 20 --repeats 1 --warmup 0 --skip compile
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import inspect
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import spikeckpt as sc
from spikeckpt import plans as P

BETA = 0.95  # snnTorch's Leaky, as in the Open Neuromorphic benchmark
LOOP = "snnTorch loop"
WRAP_KEYWORDS = set(inspect.signature(sc.wrap).parameters)


# ----------------------------------------------------------------------------- setup


@dataclass
class Setup:
    """One size: the input, the readout weight and the snnTorch model every spikeckpt row
    wraps."""

    n: int
    T: int
    batch: int
    device: torch.device
    x: Tensor  # (T, B, n) float32 spikes
    packed: Any  # spikeckpt.SpikeTrain of x
    w: Tensor  # (n,) readout weight of the loss
    fc: nn.Linear  # the reference Linear (gain applied); rows copy it
    snn_net: nn.Sequential | None  # nn.Sequential(Linear, snn.Leaky): the loop's model

    def linear(self) -> nn.Linear:
        """A fresh ``Linear`` with the reference weights."""
        fc = nn.Linear(self.n, self.n).to(self.device)
        with torch.no_grad():
            fc.weight.copy_(self.fc.weight)
            fc.bias.copy_(self.fc.bias)
        return fc

    def loss(self, total: Tensor) -> Tensor:
        """The loss of the output spikes summed over time, ``total`` ``(B, n)``."""
        return (total * self.w).sum()


def make_setup(n: int, args: argparse.Namespace) -> Setup:
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(1)
    x = (torch.rand(args.T, args.batch, n, generator=generator) < args.density).float()
    w = torch.randn(n, generator=generator)
    torch.manual_seed(0)
    fc = nn.Linear(n, n)
    with torch.no_grad():
        fc.weight.mul_(args.gain)
    fc = fc.to(device)
    x, w = x.to(device), w.to(device)
    if device.type == "cuda":  # the context and cuBLAS start here, not in the first row's call
        (w[None] @ fc.weight).sum().item()
    setup = Setup(n, args.T, args.batch, device, x, sc.SpikeTrain.from_dense(x), w, fc, None)
    try:
        import snntorch as snn
    except ImportError:
        return setup
    setup.snn_net = nn.Sequential(setup.linear(), snn.Leaky(beta=BETA)).to(device)
    return setup


#: seconds of planning in a timed call past which the row says so (a reused plan: microseconds)
PLANNING_NOTED = 1e-3

# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    """One way of running the step; filled in by ``bench``."""

    name: str
    run: Callable[[], Any]  # one forward + backward into .grad; returns (total spikes, stats)
    params: list[nn.Parameter]
    weight: nn.Parameter  # the Linear weight whose gradient is compared
    same_model: bool = True  # the snnTorch loop's neuron: gradients comparable
    first: float = 0.0
    times: list[float] = field(default_factory=list)
    peak: int = 0
    rate: float = 0.0
    plan: str = "-"
    grad: Tensor | None = None
    grad_rel: float | None = None
    planning: float = 0.0  # the most seconds a timed call spent choosing its plan
    #: what the peak must stay within: ``wrap``'s budget less the packed input, which the
    #: peak does not count (None: no budget)
    budget: int | None = None

    @property
    def over_budget(self) -> bool:
        return self.budget is not None and self.peak > self.budget

    @property
    def time(self) -> float:
        return min(self.times) if self.times else float("nan")


Skip = str  # a row that cannot run here: the reason


def snntorch_loop(s: Setup) -> Row | Skip:
    if s.snn_net is None:
        return "snnTorch is not installed"
    fc, lif = s.snn_net[0], s.snn_net[1]

    def run() -> Any:
        mem = lif.init_leaky()
        spk_rec = []
        for step in range(s.T):
            spk, mem = lif(fc(s.x[step]), mem)
            spk_rec.append(spk)
        spikes = torch.stack(spk_rec)
        total = spikes.sum(0)
        s.loss(total).backward()
        # snnTorch keeps the last membrane (and through it the loop's graph) on the neuron
        lif.mem = lif.mem.detach()
        return total.detach(), None

    return Row(LOOP, run, list(s.snn_net.parameters()), fc.weight)


def norse_eager(s: Setup) -> Row | Skip:
    try:
        from norse.torch import LIF, SequentialState
    except ImportError:
        return "Norse is not installed"
    model = SequentialState(s.linear(), LIF()).to(s.device)

    def run() -> Any:
        z, _ = model(s.x)
        total = z.sum(0)
        s.loss(total).backward()
        return total.detach(), None

    return Row(
        "Norse SequentialState(Linear, LIF), eager",
        run,
        list(model.parameters()),
        model[0].weight,
        same_model=False,
    )


def norse_compiled(s: Setup) -> Row | Skip:
    try:
        from norse.torch import LIFCell
    except ImportError:
        return "Norse is not installed"
    fc = s.linear()
    cell = torch.compile(LIFCell().to(s.device))

    def run() -> Any:
        state = None
        z_rec = []
        for step in range(s.T):
            z, state = cell(fc(s.x[step]), state)
            z_rec.append(z)
        total = torch.stack(z_rec).sum(0)
        s.loss(total).backward()
        return total.detach(), None

    return Row(
        "Norse LIFCell, torch.compile, stepped",
        run,
        list(fc.parameters()),
        fc.weight,
        same_model=False,
    )


def spikingjelly_torch(s: Setup) -> Row | Skip:
    # SpikingJelly 2 picks its CUDA LIF kernel (native, Triton or torch) when it is imported,
    # from this variable (default "auto"): the row is its torch implementation
    os.environ.setdefault("SJ_LIF_CUDA_IMPLEMENTATION", "torch")
    try:
        from spikingjelly.activation_based import functional, layer, neuron, surrogate
    except ImportError as error:
        return f"SpikingJelly does not import ({error}); `pip install spikingjelly` to add this row (not a project dependency: it pulls a torchaudio built for another torch)"
    kwargs: dict[str, Any] = {
        "tau": 1 / (1 - BETA),  # leak 1 - 1/tau = BETA
        "decay_input": False,
        "v_reset": None,  # subtract reset
        "surrogate_function": surrogate.ATan(),
        "step_mode": "m",
    }
    if "backend" in inspect.signature(neuron.LIFNode.__init__).parameters:
        kwargs["backend"] = "torch"
    fc = layer.Linear(s.n, s.n, step_mode="m").to(s.device)
    with torch.no_grad():
        fc.weight.copy_(s.fc.weight)
        fc.bias.copy_(s.fc.bias)
    model = nn.Sequential(fc, neuron.LIFNode(**kwargs)).to(s.device)

    def run() -> Any:
        functional.reset_net(model)
        total = model(s.x).sum(0)
        s.loss(total).backward()
        return total.detach(), None

    version = importlib.metadata.version("spikingjelly")
    return Row(
        f"SpikingJelly {version} LIFNode multi-step, torch",
        run,
        list(model.parameters()),
        fc.weight,
        same_model=False,
    )


def wrapped(
    s: Setup,
    name: str,
    needs: dict[str, Any],
    optional: dict[str, Any] | None = None,
    dense: bool = False,
    **kwargs: Any,
) -> Row | Skip:
    """``spikeckpt.wrap(<the snnTorch model>, readout="sum", **kwargs)``: ``needs`` are
    keywords the row cannot run without, ``optional`` ones passed only where ``wrap`` has
    them (so that this script runs before and after they exist); ``dense``: the dense input,
    not the packed train."""
    if s.snn_net is None:
        return "snnTorch is not installed"
    missing = [key for key in needs if key not in WRAP_KEYWORDS]
    if missing:
        words = ", ".join(f"{key}=" for key in missing)
        return f"spikeckpt.wrap has no {words} keyword here (issue 24's fused/compiled neurons)"
    options = {**needs, **{k: v for k, v in (optional or {}).items() if k in WRAP_KEYWORDS}}
    seq = sc.wrap(s.snn_net, readout="sum", **kwargs, **options)
    x = s.x if dense else s.packed

    def run() -> Any:
        total = seq(x)
        s.loss(total).backward()
        return total.detach(), seq.last_stats

    fc = s.snn_net[0]
    row = Row(name, run, list(s.snn_net.parameters()), fc.weight)
    if kwargs.get("budget") is not None:
        row.budget = int(kwargs["budget"]) - (0 if dense else s.packed.nbytes)
    return row


Builder = Callable[[], "Row | Skip"]


def spikeckpt_rows(
    s: Setup, args: argparse.Namespace, loop_peak: int | None
) -> list[tuple[str, Builder]]:
    """The spikeckpt rows: ``(name, builder)`` in order (budgets need the loop's peak)."""
    k = args.chunk
    share = args.share[min(args.n.index(s.n), len(args.share) - 1)]
    eager = {"compile": False}
    layer = {"granularity": "layer", "chunk": k, "storage": args.storage}
    specs: list[tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any]]] = [
        ("spikeckpt stack, BPTT()", {}, eager, {"plan": P.BPTT()}),
        ("spikeckpt stack, BPTT(), dense input", {}, eager, {"plan": P.BPTT(), "dense": True}),
    ]
    if loop_peak is not None:
        budget = int(loop_peak * share / 100) + s.packed.nbytes
        auto = {"plan": "auto", "budget": budget}
        specs += [
            (
                f"spikeckpt stack, plan=auto at {share:g}%",
                {},
                eager,
                {**auto, "granularity": "stack"},
            ),  # fmt: skip
            (f"spikeckpt auto at {share:g}%", {}, None, {**auto, "granularity": "auto"}),
        ]
    specs += [
        (
            f"spikeckpt layer-wise, chunk {k}, per-step neuron",
            {},
            {"fuse": False, "compile": False},
            layer,
        ),  # fmt: skip
        (
            f"spikeckpt layer-wise, chunk {k}, fused, eager",
            {"fuse": True, "compile": False},
            None,
            layer,
        ),  # fmt: skip
        (
            f"spikeckpt layer-wise, chunk {k}, fused, exact",
            {"fuse": True, "compile": False, "exact": True},
            None,
            layer,
        ),  # fmt: skip
        (
            f"spikeckpt layer-wise, chunk {k}, fused, compiled",
            {"fuse": True, "compile": True},
            None,
            layer,
        ),  # fmt: skip
    ]
    rows: list[tuple[str, Builder]] = [
        (name, lambda name=name, needs=needs, opt=opt, kw=kw: wrapped(s, name, needs, opt, **kw))
        for name, needs, opt, kw in specs
    ]
    if loop_peak is None:
        rows.append((f"spikeckpt budget rows at {share:g}%", lambda: "no snnTorch loop peak"))
    return rows


# ----------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe(stats: Any) -> str:
    if stats is None:
        return "-"
    if getattr(stats, "granularity", "stack") == "layer":
        ways = sorted({str(getattr(block, "neuron", "")) for block in stats.blocks} - {""})
        neuron = f", neuron {'/'.join(ways)}" if ways else ""
        return f"layer-wise(chunk={stats.chunk}){neuron}"
    return str(stats.plan)


def _call(row: Row, device: torch.device) -> tuple[float, Any]:
    """One forward + backward of ``row`` from zeroed gradients: (seconds, run's result)."""
    for p in row.params:
        p.grad = None
    gc.collect()  # untimed: no row pays for collecting another row's garbage
    _sync(device)
    start = time.perf_counter()
    result = row.run()
    _sync(device)
    return time.perf_counter() - start, result


def measure_first(row: Row, s: Setup) -> None:
    """First call (timed: compile, plan, probe), then the peak of a separate call."""
    row.first, _ = _call(row, s.device)
    for p in row.params:
        p.grad = None
    gc.collect()
    _sync(s.device)
    with sc.MemoryMeter(s.device, mode="allocator") as meter:
        total, stats = row.run()
        _sync(s.device)
    row.peak = meter.peak_bytes
    row.rate = float(total.sum()) / total.numel() / s.T
    row.plan = _describe(stats)
    row.grad = row.weight.grad.detach().clone() if row.weight.grad is not None else None


def rel_diff(grad: Tensor, ref: Tensor) -> float:
    scale = float(ref.abs().max()) or 1.0
    return float((grad - ref).abs().max()) / scale


def _wanted(name: str, args: argparse.Namespace) -> bool:
    if name == LOOP:
        return True  # the reference of every ratio
    if args.only and not any(o in name for o in args.only):
        return False
    return not (args.skip and any(o in name for o in args.skip))


def bench(n: int, args: argparse.Namespace) -> tuple[list[Row], list[tuple[str, str]]]:
    """All rows at size ``n``: the measured rows and the skipped ones ``(name, reason)``."""
    s = make_setup(n, args)
    rows: list[Row] = []
    skipped: list[tuple[str, str]] = []

    def add(label: str, builder: Builder) -> None:
        if not _wanted(label, args):
            return
        try:
            row = builder()
        except Exception as error:  # noqa: BLE001 - a row that fails to build is reported
            row = f"{type(error).__name__}: {error}"
        if isinstance(row, str):
            skipped.append((label, row))
            print(f"  n={n} {label}: skipped ({row})", flush=True)
            return
        try:
            measure_first(row, s)
        except sc.SpikeckptError as error:  # e.g. BudgetTooSmall: the row does not run
            skipped.append((row.name, f"{type(error).__name__}: {error}"))
            print(f"  n={n} {row.name}: skipped ({type(error).__name__})", flush=True)
            return
        rows.append(row)
        print(
            f"  n={n} {row.name}: first call {_seconds(row.first)}, peak "
            f"{row.peak / 2**20:.2f} MiB, {row.plan}",
            flush=True,
        )
        if row.over_budget:
            assert row.budget is not None
            print(
                f"  n={n} {row.name}: OVER ITS BUDGET: {row.peak / 2**20:.2f} MiB held where "
                f"{row.budget / 2**20:.2f} MiB were given (the input aside)",
                flush=True,
            )

    peers: list[tuple[str, Callable[[Setup], Row | Skip]]] = [
        (LOOP, snntorch_loop),
        ("Norse SequentialState(Linear, LIF), eager", norse_eager),
        ("Norse LIFCell, torch.compile, stepped", norse_compiled),
        ("SpikingJelly LIFNode multi-step, torch", spikingjelly_torch),
    ]
    for label, build in peers:
        add(label, lambda build=build: build(s))
    loop = next((r for r in rows if r.name == LOOP), None)
    for label, builder in spikeckpt_rows(s, args, loop.peak if loop else None):
        add(label, builder)
    if loop is not None and loop.grad is not None:
        for row in rows:
            if row.same_model and row.grad is not None and row is not loop:
                row.grad_rel = rel_diff(row.grad, loop.grad)
    for _ in range(args.warmup):  # untimed, interleaved
        for row in rows:
            _call(row, s.device)
    for _ in range(args.repeats):  # interleaved rounds; each row's time is its minimum
        for row in rows:
            seconds, result = _call(row, s.device)
            row.times.append(seconds)
            stats = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            row.planning = max(row.planning, getattr(stats, "planning_seconds", 0.0))
    for row in rows:  # a timed call that planned again (probes) did not time the step alone
        if row.planning > PLANNING_NOTED:
            print(f"  n={n} {row.name}: a timed call planned again ({row.planning:.3g} s)")
    return rows, skipped


# ----------------------------------------------------------------------------- report

HEADER = (
    "| n | row | plan | first call | time | x loop | peak | x loop | out rate | max rel dW |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def _seconds(value: float) -> str:
    """Seconds to three significant digits."""
    if value != value:  # nan: never timed
        return "-"
    return f"{value:.3g} s" if value < 100 else f"{value:.0f} s"


def table(n: int, rows: list[Row]) -> list[str]:
    """The Markdown rows of one size (see :data:`HEADER`)."""
    loop = next((r for r in rows if r.name == LOOP), None)
    lines = []
    for r in rows:
        ratio = f"{r.time / loop.time:.2f}" if loop else "-"
        peak_ratio = f"{r.peak / max(loop.peak, 1):.3f}" if loop else "-"
        if r.grad_rel is not None:
            dw = f"{r.grad_rel:.1e}"
        else:
            dw = "-" if r.name == LOOP else ("n/a (own LIF)" if not r.same_model else "-")
        plan = r.plan
        if r.over_budget:
            assert r.budget is not None
            plan += f", **{r.peak / r.budget:.2f}x its budget**"
        lines.append(
            f"| {n} | {r.name} | {plan} | {_seconds(r.first)} | {_seconds(r.time)} | {ratio} | "
            f"{r.peak / 2**20:.2f} MiB | {peak_ratio} | {r.rate:.3f} | {dw} |"
        )
    return lines


def _versions() -> str:
    names = ["torch", "snntorch", "norse", "spikingjelly"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def _load() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--n", type=int, nargs="+", default=[512, 2048], help="neurons (8192 is slow on a CPU)"
    )
    parser.add_argument("--T", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--density", type=float, default=0.05, help="input spike density")
    parser.add_argument("--gain", type=float, default=4.0, help="Linear weights x gain")
    parser.add_argument("--chunk", type=int, default=25, help="layer-wise chunk (steps)")
    parser.add_argument(
        "--share",
        type=float,
        nargs="+",
        default=[10.0, 20.0],
        help="budget rows: percent of the loop's peak, one per --n (the last one repeats)",
    )
    parser.add_argument("--storage", default="host", help="layer-wise storage")
    parser.add_argument("--repeats", type=int, default=3, help="timed interleaved rounds (min)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of row names")
    parser.add_argument("--skip", nargs="*", default=None, help="substrings of row names")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    device = args.device
    if device == "cuda":
        device += f" ({torch.cuda.get_device_name()})"
    header = (
        f"{datetime.date.today()}, {platform.machine()} ({os.cpu_count()} cores), {device}, "
        f"{_versions()}, {torch.get_num_threads()} thread(s), load {_load()}; Linear(n, n) + "
        f"LIF, batch {args.batch}, T = {args.T}, input density {args.density:g}, gain "
        f"{args.gain:g}; time: min of {args.repeats} interleaved rounds after "
        f"{args.warmup} warm-up; peak: MemoryMeter(mode='allocator')"
    )
    print(header, flush=True)
    lines = [HEADER]
    notes: list[str] = []
    out: list[dict[str, Any]] = []
    over = 0
    for n in args.n:
        rows, skipped = bench(n, args)
        over += sum(r.over_budget for r in rows)
        lines += table(n, rows)
        notes += [f"- n = {n}, {name}: skipped: {reason}" for name, reason in skipped]
        out += [
            {
                "n": n,
                "row": r.name,
                "plan": r.plan,
                "first_call_s": r.first,
                "times_s": r.times,
                "peak_bytes": r.peak,
                "out_rate": r.rate,
                "grad_rel": r.grad_rel,
                "same_model": r.same_model,
                "budget_bytes": r.budget,
            }
            for r in rows
        ]
        out += [{"n": n, "row": name, "skipped": reason} for name, reason in skipped]
    text = "\n".join([header, "", *lines, "", *notes, f"\nload at the end: {_load()}"])
    print("\n".join(lines), flush=True)
    if notes:
        print("\n".join(notes))
    print(f"load at the end: {_load()}")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    if over:
        print(f"{over} row(s) held more than their budget", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
