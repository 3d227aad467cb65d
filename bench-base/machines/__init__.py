"""Lifecycle definitions (YAML), shipped inside the package as `miles.machines`."""
