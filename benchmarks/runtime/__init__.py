"""Benchmarks of runtime features: split backward, equivalence, CUDA graphs, compile and float8, masks, load memory, failures and exits."""
