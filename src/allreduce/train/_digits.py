"""The real training job: scikit-learn's handwritten digits and a small MLP.

The digits (1,797 8×8 images, 10 classes) ship inside scikit-learn, so nothing is downloaded at run time. A fixed
seed splits off a held-out set; each epoch every rank draws the same permutation of the training set and takes
its own interleaved shard of it, so the N shards of one step are disjoint and together form one global batch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["DigitsData", "epoch_permutation", "global_batch_shard", "load_digits", "make_mlp", "shard_batches"]

NUM_FEATURES = 64
NUM_CLASSES = 10
NUM_DIGITS = 1797  # the size of scikit-learn's (fixed) digits dataset
_PIXEL_MAX = 16.0  # the digits' pixels are integers 0..16


def num_train_samples(held_out_fraction: float = 0.2) -> int:
    """How many digits :func:`load_digits` keeps for training, known without importing torch or scikit-learn."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    return NUM_DIGITS - round(NUM_DIGITS * held_out_fraction)


@dataclass(frozen=True, eq=False)
class DigitsData:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def _digits_table() -> np.ndarray[Any, Any]:
    """The 1,797 rows of 64 pixels and the label, straight from the file scikit-learn ships.

    Importing scikit-learn costs seconds on a loaded machine, in every rank; its digits are a small CSV inside the
    package, found without importing it. Through scikit-learn when the file is not where it has always been.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    return np.column_stack([bunch.data, bunch.target])


def load_digits(*, held_out_fraction: float = 0.2, seed: int = 0) -> DigitsData:
    """The digits, scaled to [0, 1], split into training and held-out sets by a seeded permutation."""

    import torch

    num_train = num_train_samples(held_out_fraction)

    table = _digits_table()
    x = np.asarray(table[:, :NUM_FEATURES], dtype=np.float32) / _PIXEL_MAX
    y = np.asarray(table[:, NUM_FEATURES], dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    if len(y) != NUM_DIGITS:
        raise RuntimeError(f"scikit-learn's digits has {len(y)} samples, expected {NUM_DIGITS}")
    test, train = order[: NUM_DIGITS - num_train], order[NUM_DIGITS - num_train :]
    return DigitsData(
        torch.from_numpy(x[train]), torch.from_numpy(y[train]), torch.from_numpy(x[test]), torch.from_numpy(y[test])
    )


def make_mlp(hidden: tuple[int, ...] = (128, 64), *, seed: int = 0) -> nn.Sequential:
    """An MLP 64 -> hidden... -> 10 with ReLU, initialised from ``seed`` (rank 0's copy is broadcast anyway)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = NUM_FEATURES
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, NUM_CLASSES))
    return nn.Sequential(*layers)


def epoch_permutation(num_samples: int, *, epoch: int, seed: int = 0) -> torch.Tensor:
    """The order in which every rank reads the training set in ``epoch`` (the same on every rank)."""
    import torch

    return torch.from_numpy(np.random.default_rng((seed, epoch)).permutation(num_samples))


def global_batch_shard(perm: torch.Tensor, *, step: int, global_batch: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of global batch ``step``: ``perm[step*G : (step+1)*G]`` cut into ``world_size`` nearly
    equal consecutive slices (the first ``G mod world_size`` one sample longer). With ``G = world_size × B`` the
    slices are those of :func:`shard_batches`; after a group shrinks, its survivors cut the same global batch."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not a rank of {world_size}")
    base, longer = divmod(global_batch, world_size)
    lo = step * global_batch + rank * base + min(rank, longer)
    return perm[lo : lo + base + (rank < longer)]


def shard_batches(
    num_samples: int, *, rank: int, world_size: int, batch_size: int, epoch: int, seed: int = 0
) -> list[torch.Tensor]:
    """This rank's sample indices for each step of ``epoch``: the same number of steps on every rank.

    Step k of rank r holds samples ``perm[k*N*B + r*B : k*N*B + (r+1)*B]``, so rank r's shard of a global batch of
    N·B samples is its r-th slice, and the single-process equivalent of step k is ``perm[k*N*B : (k+1)*N*B]``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    global_batch = batch_size * world_size
    steps = num_samples // global_batch
    if steps == 0:
        raise ValueError(
            f"{num_samples} training samples are fewer than one global batch of {world_size} ranks × {batch_size}"
        )
    perm = epoch_permutation(num_samples, epoch=epoch, seed=seed)
    return [
        global_batch_shard(perm, step=k, global_batch=global_batch, rank=rank, world_size=world_size)
        for k in range(steps)
    ]
