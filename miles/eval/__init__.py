"""Evaluation: metrics and the eval phase's helpers."""
