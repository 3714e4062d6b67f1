"""Benchmarks of spikeckpt strategies: ``spikeckpt bench`` and the paper-claim reproductions."""

#: The strategies ``spikeckpt bench --strategies`` knows, in order (checked while parsing,
#: without importing torch; the same names as `spikeckpt.bench.strategies.STRATEGIES`).
STRATEGY_NAMES = (
    "bptt",
    "checkpoint",
    "save_on_cpu",
    "uniform-sqrt",
    "uniform",
    "revolve",
    "double-host",
    "double-disk",
    "twolevel",
    "twolevel-async",
    "layerwise",
    "layerwise-disk",
)
