"""pipetrain against Megatron-Core, DeepSpeed and torch.distributed.pipelining, the statistics over launches, and the plan of a GPU call."""
