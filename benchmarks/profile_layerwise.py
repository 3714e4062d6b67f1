"""Where the layer-wise step spends its time: the profiler's top operations, against the loop.

The peers' setup (``benchmarks/bench_peers.py``: ``Linear(n, n)`` + ``snn.Leaky``, batch 16,
T = 500, 5% input spikes, loss on the output spikes): the snnTorch loop and
``spikeckpt.wrap(..., granularity="layer", chunk=25)`` (fused neuron, packed input) and the
stack granularity's ``BPTT()`` (packed input: 1.5-1.6x the loop on the H200), one
untimed forward + backward each, then one of each under ``torch.profiler`` (CPU activity, and
CUDA's on a GPU). Printed per run: its wall time unprofiled (minimum of ``--repeats``), the
profiler's top operations by self time on the device (CUDA: kernels; CPU: ops), and the host's
waits for the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy*``)
and, apart, its value reads (``aten::item`` / ``_local_scalar_dense``: a wait when the tensor
is on the device, none for a host tensor such as an index train's offsets). Made for the
question the H200 left (layer-wise fused at n = 8192 took 1.70x the loop's time there).

    python benchmarks/profile_layerwise.py --device cuda --n 8192   # the GPU (suite step 7)
    python benchmarks/profile_layerwise.py --n 2048                 # the CPU
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import make_setup, snntorch_loop, wrapped  # noqa: E402

from spikeckpt.plans import BPTT  # noqa: E402

#: host calls that wait for the device (or copy through it)
WAITS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMemcpyAsync",
)
#: reads of a tensor's value: a device wait for a device tensor, none for a host one (the
#: profiler does not say which; an index train's offsets live on the host)
READS = ("aten::item", "aten::_local_scalar_dense")


def runs(setup: Any, chunk: int, storage: str) -> dict[str, Callable[[], Any]]:
    """The two runs, the peers' benchmark's own rows: name -> one forward + backward into
    ``.grad``."""
    loop = snntorch_loop(setup)
    layer = wrapped(
        setup,
        f"spikeckpt layer-wise, chunk {chunk}, fused, eager",
        {"fuse": True, "compile": False},
        granularity="layer",
        chunk=chunk,
        storage=storage,
    )
    stack = wrapped(setup, "spikeckpt stack, BPTT()", {}, {"compile": False}, plan=BPTT())
    for row in (loop, layer, stack):
        if isinstance(row, str):  # a Skip: why the row cannot run here
            sys.exit(f"profile_layerwise.py: {row}")
    return {
        "snnTorch loop": loop.run,
        f"layer-wise fused, chunk {chunk}": layer.run,
        "stack BPTT()": stack.run,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--n", type=int, default=None, help="neurons (default: 8192 on cuda)")
    parser.add_argument("--T", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=25)
    parser.add_argument("--storage", default="host")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=15, help="operations listed per run")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    n = args.n or (8192 if args.device == "cuda" else 2048)
    torch.set_num_threads(args.threads)
    setup = make_setup(
        n,
        argparse.Namespace(device=args.device, T=args.T, batch=args.batch, density=0.05, gain=4.0),
    )
    if setup.snn_net is None:
        sys.exit("profile_layerwise.py needs snnTorch")
    cuda = setup.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    todo = runs(setup, args.chunk, args.storage)
    best = dict.fromkeys(todo, float("inf"))
    for run in todo.values():  # untimed: plans, checks the kernel
        run()
    for _ in range(args.repeats):
        for name, run in todo.items():
            setup.snn_net.zero_grad(set_to_none=True)
            gc.collect()
            sync()
            start = time.perf_counter()
            run()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    where = torch.cuda.get_device_name() if cuda else "the CPU"
    print(f"n = {n}, T = {args.T}, batch {args.batch}, {where}, torch {torch.__version__}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    for name, run in todo.items():
        setup.snn_net.zero_grad(set_to_none=True)
        sync()
        with profile(activities=activities) as prof:
            result = run()
            sync()
        events = prof.key_averages()
        print(f"\n## {name}: {best[name]:.4g} s (min of {args.repeats}, unprofiled)\n")
        print(events.table(sort_by=key, row_limit=args.top, max_name_column_width=60))
        waits = {e.key: e.count for e in events if any(e.key.startswith(w) for w in WAITS)}
        reads = {e.key: e.count for e in events if e.key in READS}
        print("device synchronizations and copies:", waits or "none")
        print("value reads (of host or device tensors):", reads or "none")
        stats = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if stats is not None:  # probes inside the profiled call would be profiled too
            print(f"planning inside the call: {stats.planning_seconds:.3g} s")
    ratio = best[f"layer-wise fused, chunk {args.chunk}"] / best["snnTorch loop"]
    print(f"\nlayer-wise / loop: {ratio:.2f}")
    print(f"stack BPTT() / loop: {best['stack BPTT()'] / best['snnTorch loop']:.2f}")


if __name__ == "__main__":
    main()
