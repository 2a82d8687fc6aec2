"""What several benchmark folders share: the GPU process context and presets, the launch-and-step
intervals, the local launcher, and the runner of a device call's steps."""
