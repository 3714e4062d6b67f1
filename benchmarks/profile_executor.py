"""Profile the overhead of ``spikeckpt.scan``'s executor (a script, not a test).

Same network as ``bench_scan.py`` (2 LIF layers, batch 32, 700 inputs at 5% density, summed
output spikes). For each plan it reports the median time of forward + backward over
``--repeats`` runs, the step evaluations per time step, and an "overhead" estimate: the time
above ``evaluations * c_f + T * c_b`` where ``c_f`` / ``c_b`` (forward / backward of one step)
are measured on the plain BPTT loop. ``--cprofile PLAN`` prints the top functions of one run of
that plan (cumulative and self time); ``--torch-profile PLAN`` prints ``torch.profiler``'s
operator table.

    python benchmarks/profile_executor.py --T 1000 --threads 1
    python benchmarks/profile_executor.py --T 1000 --only revolve --cprofile revolve
    PYTHONPATH=/path/to/other/checkout python benchmarks/profile_executor.py   # compare builds
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_scan import LIF2, _loss  # noqa: E402

import spikeckpt as sc  # noqa: E402
from spikeckpt import plans as P  # noqa: E402
from spikeckpt.engine.saved import measure_step  # noqa: E402


def _plans(T: int, S: int, A: int, folder: str) -> dict[str, tuple[Any, str, str | None]]:
    k = math.isqrt(T - 1) + 1
    ckpt_bytes = math.ceil(T / k) * S + k * A  # torch.utils.checkpoint per sqrt(T), modeled
    slots = max(1, min(T, (ckpt_bytes - A) // S - 1))
    return {
        "bptt": (P.BPTT(), "host", None),
        "uniform": (P.Uniform(), "host", None),
        "revolve": (P.Revolve(slots), "host", None),
        "double-disk": (P.Double(state_bytes=S, step_bytes=A), "disk", folder),
        "double-host": (P.Double(state_bytes=S, step_bytes=A), "host", None),
    }


def _runner(plan: Any, storage: str, folder: str | None) -> Callable[..., Any]:
    def run(net: LIF2, x: torch.Tensor, s0: Any) -> Any:
        out = sc.scan(net, x, s0, plan=plan, storage=storage, readout="sum", directory=folder)
        _loss(out.ys).backward()
        return out.stats

    return run


def _loop(net: LIF2, x: torch.Tensor, s0: Any) -> Any:
    state, count = s0, None
    for t in range(x.shape[0]):
        state, z = net(state, x[t])
        count = z if count is None else count + z
    return count


CLOCK = time.perf_counter


def _median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--T", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inputs", type=int, default=700)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of plan names")
    parser.add_argument("--cprofile", default=None, help="profile one run of this plan")
    parser.add_argument("--torch-profile", default=None, help="torch.profiler on this plan")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with process CPU time (steadier than wall time on a shared machine)",
    )
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    T = args.T
    net = LIF2(args.inputs, args.hidden)
    x = (torch.rand(T, args.batch, args.inputs) < 0.05).float()
    s0 = (torch.zeros(args.batch, args.hidden), torch.zeros(args.batch, args.hidden))
    probe = measure_step(net, s0, x[0], list(net.parameters()))
    S, A = probe.state_bytes, probe.step_bytes

    # c_f: one untaped step; c_b: BPTT time minus its taped forward, per step.
    def forward_only() -> None:
        with torch.no_grad():
            _loop(net, x, s0)

    def bptt() -> None:
        net.zero_grad(set_to_none=True)
        _loss(_loop(net, x, s0)).backward()

    def taped_forward() -> None:
        _loop(net, x, s0)

    forward_only()
    bptt()
    c_f = _median(forward_only, args.repeats) / T
    t_bptt = _median(bptt, args.repeats)
    c_b = (t_bptt - _median(taped_forward, args.repeats)) / T
    print(
        f"spikeckpt from {Path(sc.__file__).parent}\n"
        f"T={T}, {torch.get_num_threads()} thread(s), {'CPU' if args.cpu_time else 'wall'} time; "
        f"BPTT loop {t_bptt:.3f} s; "
        f"c_f {c_f * 1e6:.0f} us, c_b {c_b * 1e6:.0f} us"
    )
    with tempfile.TemporaryDirectory(prefix="profile-executor-") as folder:
        plans = _plans(T, S, A, folder)
        for name, (plan, storage, directory) in plans.items():
            if args.only and not any(o.lower() in name for o in args.only):
                continue
            run = _runner(plan, storage, directory)
            net.zero_grad(set_to_none=True)
            stats = run(net, x, s0)  # warm-up
            n_actions = len(stats.schedule.forward) + len(stats.schedule.backward)
            n_backprops = sum(type(a) is sc.plans.Backprop for a in stats.schedule.backward)

            def once(run: Callable[..., Any] = run) -> None:
                net.zero_grad(set_to_none=True)
                run(net, x, s0)

            seconds = _median(once, args.repeats)
            model = stats.forward_steps * c_f + T * c_b
            print(
                f"  {name:<12} {stats.plan[:36]:<36} {seconds:7.3f} s  x{seconds / t_bptt:5.2f}  "
                f"evals/T {stats.recompute_factor:5.2f}  model {model:6.3f} s  "
                f"overhead {seconds - model:+6.3f} s  ({n_actions} actions, "
                f"{n_backprops} backprops)"
            )
        if args.cprofile:
            plan, storage, directory = plans[args.cprofile]
            run = _runner(plan, storage, directory)
            profiler = cProfile.Profile()
            net.zero_grad(set_to_none=True)
            profiler.enable()
            run(net, x, s0)
            profiler.disable()
            stats_ = pstats.Stats(profiler)
            stats_.sort_stats("cumulative").print_stats(args.top)
            stats_.sort_stats("tottime").print_stats(args.top)
        if args.torch_profile:
            plan, storage, directory = plans[args.torch_profile]
            run = _runner(plan, storage, directory)
            net.zero_grad(set_to_none=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(net, x, s0)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
