#!/usr/bin/env bash
# Reproduce the paper-claim measurements of docs/benchmarks.md (CPU, one torch thread).
# Each command writes a table to stdout and JSON, CSV, Markdown and a PNG plot into its --out.
set -euo pipefail
B="python -m spikeckpt bench --threads 1"

# Gruslys et al. (T=1000, 5% budget) and Chen et al. (sqrt(T) checkpointing), time overheads.
$B --T 1000,2000 --budget 5% \
    --strategies bptt,checkpoint,uniform-sqrt,uniform,revolve,double-disk,twolevel \
    --repeats 3 --out spikeckpt-out/sweep
# Bencheikh et al.: longest sequence in a 2 MiB device budget (disk tier holds the checkpoints).
$B --max-length 2MiB --strategies bptt,checkpoint,double-disk --out spikeckpt-out/maxlen
# Bencheikh et al.: widest network at T=200 in a 4 MiB device budget.
$B --max-width 4MiB --T 200 --strategies bptt,checkpoint,double-disk --out spikeckpt-out/maxwidth
# Kukreja et al.: time per step of the asynchronous two-level scheme as T grows 10x and 100x.
$B --T 40,400,4000 --strategies bptt,twolevel-async,double-disk --hidden 32 --batch 4 \
    --inputs 32 --repeats 3 --out spikeckpt-out/kukreja
