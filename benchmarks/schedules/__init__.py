"""Benchmarks of building, lowering, validating and simulating the schedules."""
