"""Benchmarks of activation recompute: its cost under the pipeline, its memory, its price per stage."""
