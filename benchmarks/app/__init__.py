"""Scripts that run the application (pipetrain demo and train) on GPUs."""
