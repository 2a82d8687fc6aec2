"""pipetrain against torch.distributed.pipelining on GPUs: the benchmark, its limit, memory model and report, and the run of all three."""
