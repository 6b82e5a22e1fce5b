"""The error every executor raises when it cannot run a step (a worker failed or died).
Lives outside daemon/gpu so the scheduler side can catch it without importing torch."""


class ExecutorError(RuntimeError):
    """The message names the cause (which worker, its exit code or exception)."""
