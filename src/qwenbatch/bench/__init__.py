"""Benchmarks: fixed-seed workloads, our engine beside the transformers baseline, one run."""
