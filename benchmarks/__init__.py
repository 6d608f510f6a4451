"""Benchmarks that print numbers (not installed; ``python -m benchmarks --help``)."""
