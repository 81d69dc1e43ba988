"""The torch backend and threads: a training loop in a thread of its own works once the group is handed over,
and is refused (never silently mis-paired) when it is not."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("torch")

from allreduce.runtime.launcher._spawn import spawn


def _in_a_thread(rank: int, world_size: int, hand_over: bool) -> dict[str, Any]:
    import torch.distributed as dist

    import allreduce.torch
    import torch

    dist.init_process_group("allreduce", rank=rank, world_size=world_size)
    out: dict[str, Any] = {}

    def train_loop() -> None:
        x = torch.full((4,), float(rank + 1))
        try:
            dist.all_reduce(x)
            out["sum"] = x.tolist()
        except Exception as exc:  # the outcome is what the test checks
            out["error"] = type(exc).__name__

    trainer = threading.Thread(target=train_loop, name="trainer")
    if hand_over:
        allreduce.torch.hand_over(trainer)
    trainer.start()
    trainer.join()
    y = torch.ones(2)
    dist.all_reduce(y)  # the main thread owns the group again (or never gave it away)
    out["after"] = y.tolist()
    dist.destroy_process_group()
    return out


def _worker(hand_over: bool) -> dict[str, Any]:
    import os

    return _in_a_thread(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), hand_over)


@pytest.mark.slow
def test_a_handed_over_training_thread_gets_exact_sums() -> None:
    for out in spawn(2, _worker, True, group=False, timeout_s=200, env={"OMP_NUM_THREADS": "1"}):
        assert out["sum"] == [3.0] * 4
        assert out["after"] == [2.0, 2.0]


@pytest.mark.slow
def test_a_training_thread_without_the_group_is_refused_on_every_rank() -> None:
    for out in spawn(2, _worker, False, group=False, timeout_s=200, env={"OMP_NUM_THREADS": "1"}):
        assert out["error"] == "WrongThreadError"
        assert out["after"] == [2.0, 2.0]
