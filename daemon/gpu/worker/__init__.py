"""The worker side of a step: the model runner and its batch, the executors and the worker process, CUDA graphs, the memory profile."""
