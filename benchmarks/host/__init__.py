"""Benchmarks of the host's share of a step: issuing layers, launching graphs, profiles of the split backward."""
