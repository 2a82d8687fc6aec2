"""Benchmarks of activation offload and the host link it uses."""
