"""Data-parallel training on allreduce: gradient buckets overlapped with backward, and a real training run."""

from allreduce.train._local import RankFailedError, free_port, run_local

__all__ = ["RankFailedError", "free_port", "run_local"]
