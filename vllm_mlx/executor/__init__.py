"""What runs the model: the runner, paged attention, sampling, the recurrent-state pool
and the CPU kernels."""
