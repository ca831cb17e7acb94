"""infer-bench: the driver (CLI entry points, runner, metrics, memory sampling, results)."""

__version__ = "0.1.0"
