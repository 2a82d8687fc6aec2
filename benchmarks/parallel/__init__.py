"""Benchmarks of the pipeline combined with data and tensor parallelism."""
