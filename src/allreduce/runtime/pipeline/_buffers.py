"""A user's array or tensor seen as the 1-D contiguous numpy array a transport works on.

numpy arrays of any shape are used as they are when C-contiguous; a strided view goes through a contiguous copy
(C order, so every rank flattens the same way) that is written back after the collective. CPU torch tensors are
viewed as numpy without a copy (bfloat16 through its bits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from allreduce.runtime.pipeline._descriptor import DTYPE_CODES, DTYPES, dtype_code

__all__ = ["Buffer", "as_buffer", "check_dtype", "is_torch", "torch_to_numpy"]


class Buffer:
    """``flat`` is what the transport works on; ``original`` is what the caller passed (and gets back).

    A plain class with slots, not a frozen dataclass: one is made per collective, and a frozen dataclass's
    ``__init__`` costs about a microsecond of the small-message latency.
    """

    __slots__ = ("array", "copied", "flat", "original")

    def __init__(self, original: Any, array: npt.NDArray[Any], flat: npt.NDArray[Any], *, copied: bool) -> None:
        self.original = original
        self.array = array  # numpy view of the user's memory (any strides)
        self.flat = flat  # 1-D contiguous: a view of `array`, or a copy that is written back
        self.copied = copied

    def write_back(self) -> None:
        if self.copied:
            self.array[...] = self.flat.reshape(self.array.shape)

    def block(self, start: int, stop: int) -> Any:
        """Elements ``[start, stop)`` of the caller's object, flattened (a view, of the caller's type)."""
        if is_torch(self.original):
            return self.original.reshape(-1)[start:stop]
        return self.array.reshape(-1)[start:stop]


def check_dtype(dtype: np.dtype[Any], what: str) -> np.dtype[Any]:
    """``dtype`` if collectives support it, else ``TypeError`` naming ``what`` and the supported dtypes."""
    if dtype not in DTYPE_CODES and dtype_code(dtype) is None:
        raise TypeError(f"{what}: unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
    return dtype


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def torch_to_numpy(tensor: Any, what: str) -> npt.NDArray[Any]:
    import torch

    if tensor.device.type != "cpu":
        raise ValueError(f"{what}: only CPU tensors are supported, got a tensor on {tensor.device}")
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        return np.asarray(t.view(torch.int16).numpy().view(DTYPES["bfloat16"]))
    array: npt.NDArray[Any] = t.numpy()
    return array


def as_buffer(
    x: Any, what: str, *, check: Callable[[np.dtype[Any], str], object] = check_dtype, writable: bool = True
) -> Buffer:
    """``x`` (a numpy array or a CPU torch tensor) as a :class:`Buffer`; ``what`` names it in errors. ``check``
    refuses the dtypes the caller cannot move; ``writable``: the caller writes into it (read-only arrays refused)."""
    if isinstance(x, np.ndarray):
        array = x
    elif is_torch(x):
        array = torch_to_numpy(x, what)
    else:
        raise TypeError(f"{what}: expected a numpy array or a torch CPU tensor, got {type(x).__name__}")
    check(array.dtype, what)
    if writable and not array.flags.writeable:
        raise ValueError(f"{what}: the array is read-only; collectives work in place")
    if array.flags.c_contiguous:
        return Buffer(x, array, array.reshape(-1), copied=False)
    return Buffer(x, array, np.ascontiguousarray(array).reshape(-1), copied=True)
