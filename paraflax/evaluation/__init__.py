"""Benchmarks and metrics."""
