"""The experiments behind pdserve's performance claims (docs/benchmarks.md and its pages under docs/benchmarks/).

Each module is one script, `python -m bench.experiments.NAME`, that starts its own processes,
drives them with `bench.serve` (or reuses bench/engine.py, bench/kvtransfer.py), and writes
JSON + PNG into bench/results/. `python -m bench.experiments.all` regenerates every one.
"""
