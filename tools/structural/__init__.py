"""Structural benchmarks: FFN blocks replaced or pruned — the frontier, the gate's promise, the profiler, what
ranks a block's damage, and the runs of the structural checkpoints."""
