"""Metrics sinks and plots."""
