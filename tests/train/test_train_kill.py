"""``allreduce train --kill-rank R@STEP``: a rank is SIGKILLed mid-training and the survivors finish the run.

The survivors shrink the group, re-run the failed step on the same global batch cut over fewer ranks, and end
as identical replicas (``summarize`` refuses differing parameters).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from allreduce.train import TrainConfig, TrainResult, format_result
from allreduce.train._digits import epoch_permutation, global_batch_shard, shard_batches


@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 3))
def test_the_shards_of_a_global_batch_partition_it_within_one_sample(world: int, batch: int, step: int) -> None:
    global_batch = world * batch + step  # any size, divisible by the world or not
    perm = epoch_permutation(global_batch * 5, epoch=1)
    shards = [
        global_batch_shard(perm, step=step, global_batch=global_batch, rank=r, world_size=world) for r in range(world)
    ]
    joined = [int(i) for shard in shards for i in shard]
    assert joined == [int(i) for i in perm[step * global_batch : (step + 1) * global_batch]]
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_an_evenly_divided_global_batch_is_cut_as_before_any_shrink() -> None:
    perm = epoch_permutation(1438, epoch=2)
    batches = shard_batches(1438, rank=2, world_size=4, batch_size=32, epoch=2)
    assert [int(i) for i in batches[3]] == [int(i) for i in perm[3 * 128 + 64 : 3 * 128 + 96]]


@pytest.mark.slow
@pytest.mark.serial
def test_the_survivors_of_a_killed_rank_finish_the_run_on_the_same_global_batch(
    run_allreduce: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    out = run_allreduce("train", "-n", "4", "--epochs", "1", "--kill-rank", "3@4", "--json", timeout_s=300)
    assert out.returncode == 0, out.stderr
    elastic = json.loads(out.stdout)["elastic"]
    assert elastic["killed_rank"] == 3
    assert elastic["how"] == "was killed by SIGKILL"
    assert elastic["survivors"] == [0, 1, 2]
    assert elastic["failed_step"] == [4]  # every survivor raised in the step the victim never joined
    assert elastic["errors"] == ["PeerFailureError naming rank 3"]
    assert elastic["shards"] == [43, 43, 42]  # 128 samples kept, over 3 ranks
    assert 0 < elastic["shrink_s"] < elastic["next_step_after_s"]


def test_the_terminal_says_who_died_and_how_the_survivors_went_on() -> None:
    config = TrainConfig(world_size=3, epochs=1, kill_rank=2, kill_step=20)
    elastic = {
        "killed_rank": 2,
        "how": "was killed by SIGKILL",
        "step": 20,
        "failed_step": [20],
        "errors": ["PeerFailureError naming rank 2"],
        "survivors": [0, 1],
        "raised_after_s": 0.004,
        "shrink_s": 0.02,
        "next_step_after_s": 0.05,
        "shards": [48, 48],
        "global_batch": 96,
    }
    result = TrainResult(
        config=config,
        epochs=[],
        slowest_rank=1,
        compute_per_rank_s=[0.002, 0.003],
        steps_per_epoch=14,
        buckets=1,
        group="allreduce shm transport",
        extra={"elastic": elastic},
    )
    text = format_result(result)
    assert "slowest rank: 1 (compute 3 ms/step vs 2 ms on the others)" in text
    assert "rank 2 was killed by SIGKILL before step 20 (epoch 2); survivors 0, 1 went on without it:" in text
    assert "global batch 96 kept: 48/48 samples per survivor; parameters identical on all 2" in text
