"""Measuring the runtime: N local ranks time all_reduce over a sweep of sizes, every result checked (what
``allreduce bench``, ``allreduce tune`` and the runtime benchmark present)."""
