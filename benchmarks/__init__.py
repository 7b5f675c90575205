"""Benchmark suite: what offloading costs and saves, against native execution and the other offloaders.

Entry points: ``python -m benchmarks.run`` (one workload, every method in its own process) and
``python -m benchmarks.report`` (tables and plots for ``docs/benchmarks.md`` and
``docs/benchmarks-log.md``).
"""
