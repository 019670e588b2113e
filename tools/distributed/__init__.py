"""Distributed benchmarks: data-parallel runs and size plans under torchrun against one process."""
