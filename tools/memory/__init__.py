"""Memory and large-run benchmarks: peak memory and time, onloaded and held, their projection, and resume."""
