"""Training: the loop, checkpoints, metric sinks. Composes model, data, optim and parallel."""
