"""Benchmarks: timings and sizes of packstore's paths, each run as ``python -m tools.bench.NAME`` (docs/benchmarks.md)."""
