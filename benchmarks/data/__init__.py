"""Benchmarks of the data path: length-aware micro-batches and packed tokens."""
