"""Benchmarks and their helpers (not part of the installed package)."""
