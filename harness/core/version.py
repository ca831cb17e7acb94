"""infer-bench's own version (the package's; pyproject.toml says the same), where every layer may
read it: the rows' engine_version of the reference engine, infer-bench-serve's /version."""

__version__ = "0.1.0"
