"""Measuring the runtime: N local ranks time all_reduce over a sweep of sizes, every result checked (what
``allreduce bench``, ``allreduce tune`` and the runtime benchmark present)."""

from allreduce.runtime.bench._bench import BenchConfig, BenchRow, run_bench

__all__ = ["BenchConfig", "BenchRow", "run_bench"]
