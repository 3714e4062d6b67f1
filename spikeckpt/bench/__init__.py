"""Benchmarks of spikeckpt strategies: ``spikeckpt bench`` and the paper-claim reproductions."""
