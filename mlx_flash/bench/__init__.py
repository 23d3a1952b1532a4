"""Benchmarks behind `mlx_flash.benchmark` (the CLI is mlx_flash/cli/benchmark.py).

Owns storage.py (the disk), paper.py + trace.py (the paper's tables on random checkpoints of
real shapes: convert/random_model.py), peers/ (mlx_flash, mlx_lm, llama.cpp under one memory
cgroup). May import everything below it (loader, runtime's package API, io, layout, the
machine probe plan/measure.py); nothing imports it but the benchmark CLI (cli/benchmark.py).
"""
