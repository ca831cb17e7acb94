"""infer-bench: the driver (CLI entry points, runner, metrics, memory sampling, results)."""

from harness.core.version import __version__

__all__ = ["__version__"]
