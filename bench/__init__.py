"""Benchmarks: each script prints a table and writes JSON and a PNG under ``docs/benchmarks/``.

Run them from the repository root as modules, e.g. ``python -m bench.collectives``.
"""
