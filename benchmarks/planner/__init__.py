"""Benchmarks of the planner: its picks measured on GPUs, how near to optimal, how fast."""
