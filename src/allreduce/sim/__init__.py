"""Flow-level network simulation: run a schedule on a topology with max-min fair link sharing."""

from allreduce.sim._fair import FairShare, max_min_rates

__all__ = ["FairShare", "max_min_rates"]
