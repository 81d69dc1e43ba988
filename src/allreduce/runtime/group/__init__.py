"""The process group and how a rank joins one: ``init()`` (environment, store, a transport from the registry), the
collectives of :class:`ProcessGroup`, in-process groups for tests, and the cost models ``auto`` picks by.

The group and ``init`` are exported by :mod:`allreduce.runtime`; here, what ``allreduce tune`` takes besides: the
built-in cost models and the file measured ones are cached in."""

from allreduce.runtime.group._cost_models import default_cost_model
from allreduce.runtime.group._tune import save_cost_model, tune_file

__all__ = ["default_cost_model", "save_cost_model", "tune_file"]
