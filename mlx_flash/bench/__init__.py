"""Benchmarks behind `mlx_flash.benchmark` (the CLI is mlx_flash/cli/benchmark.py)."""
