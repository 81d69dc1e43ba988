"""Data-parallel training on allreduce: gradient buckets overlapped with backward, and a real training run."""

from allreduce.train._data_parallel import DataParallel, SyncStats, bucket_layout
from allreduce.train._digits import DigitsData, load_digits, make_mlp, shard_batches
from allreduce.train._local import RankFailedError, free_port, run_local
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
    "format_result",
    "free_port",
    "load_digits",
    "make_mlp",
    "run_local",
    "shard_batches",
    "train",
    "train_rank",
]
