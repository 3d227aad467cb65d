"""A fake `sglang` package for tests: only `python -m sglang.launch_server` exists (see tests/fakes)."""

__version__ = "0.5.23+fake"
