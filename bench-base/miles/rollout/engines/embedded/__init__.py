"""The embedded engine: a transformers model and torch sampling, on CPU or GPU."""
