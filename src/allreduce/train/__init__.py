"""Data-parallel training on allreduce: gradient buckets overlapped with backward, and a real training run.

Names are imported on first use (PEP 562), so that ``allreduce --help`` and the CLI's parser do not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from allreduce.runtime import RankFailedError
    from allreduce.train._data_parallel import DataParallel, SyncStats, bucket_layout
    from allreduce.train._digits import (
        DigitsData,
        epoch_permutation,
        global_batch_shard,
        load_digits,
        make_mlp,
        shard_batches,
    )
    from allreduce.train._elastic import sync_state
    from allreduce.train._run import (
        TRANSPORTS,
        EpochReport,
        TrainConfig,
        TrainResult,
        demo,
        format_result,
        train,
        train_rank,
    )

_WHERE = {
    "DataParallel": "_data_parallel",
    "SyncStats": "_data_parallel",
    "bucket_layout": "_data_parallel",
    "DigitsData": "_digits",
    "epoch_permutation": "_digits",
    "global_batch_shard": "_digits",
    "load_digits": "_digits",
    "make_mlp": "_digits",
    "shard_batches": "_digits",
    "RankFailedError": "allreduce.runtime",
    "TRANSPORTS": "_run",
    "EpochReport": "_run",
    "TrainConfig": "_run",
    "TrainResult": "_run",
    "demo": "_run",
    "format_result": "_run",
    "train": "_run",
    "train_rank": "_run",
    "sync_state": "_elastic",
}

__all__ = [
    "TRANSPORTS",
    "DataParallel",
    "DigitsData",
    "EpochReport",
    "RankFailedError",
    "SyncStats",
    "TrainConfig",
    "TrainResult",
    "bucket_layout",
    "demo",
    "epoch_permutation",
    "format_result",
    "global_batch_shard",
    "load_digits",
    "make_mlp",
    "shard_batches",
    "sync_state",
    "train",
    "train_rank",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'allreduce.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module if "." in module else f"allreduce.train.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
