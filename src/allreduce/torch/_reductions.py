"""torch's reduce ops and dtypes in terms of the runtime's: what the backend hands the group, and how it finishes.

The runtime reduces float16/bfloat16/float32/float64 and int8-64/uint8 with sum, avg, prod, min and max. The
backend takes what Gloo takes besides, without a second reduction engine:

- bool: its bytes as uint8 (0 or 1), where OR is max and AND is min: SUM, MAX and BOR are OR, PRODUCT, MIN and
  BAND are AND (Gloo's results for bool);
- uint16/32/64: the bits as the signed type of the same width. Two's-complement sum and product are the same
  bits as the unsigned ones (both wrap modulo 2^bits); for MIN and MAX the sign bit is flipped first (a copy),
  which maps unsigned order onto signed order, and flipped back into the tensor after;
- BAND, BOR, BXOR of integers (and BXOR of bool): every rank's tensor is all-gathered and reduced locally in rank
  order, so every rank computes the same bits; N times the traffic of an all-reduce.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import torch

__all__ = ["Reduction", "as_runtime_dtype", "reduction"]

_SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
_SIGN_BIT = {torch.int16: -(1 << 15), torch.int32: -(1 << 31), torch.int64: -(1 << 63)}
_RUNTIME_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
)
_BITWISE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "band": torch.bitwise_and,
    "bor": torch.bitwise_or,
    "bxor": torch.bitwise_xor,
}


def _op_name(op: Any) -> str:
    names = {
        dist.ReduceOp.SUM: "sum",
        dist.ReduceOp.AVG: "avg",
        dist.ReduceOp.PRODUCT: "prod",
        dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max",
        dist.ReduceOp.BAND: "band",
        dist.ReduceOp.BOR: "bor",
        dist.ReduceOp.BXOR: "bxor",
    }
    for known, name in names.items():
        if op == known:
            return name
    raise ValueError(
        f"the allreduce backend reduces with SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR, not {op} "
        f"(PREMUL_SUM: scale the tensor, then SUM)"
    )


@dataclass(frozen=True)
class Reduction:
    """How to reduce one tensor. ``buffer`` goes to the runtime with ``op``; ``finish()`` (run once the collective
    has finished) moves the result into the caller's tensor. ``op`` None: all-gather ``buffer``, then
    ``finish(gathered)`` reduces the N blocks in rank order."""

    buffer: torch.Tensor
    op: str | None
    finish: Callable[..., Any]

    @property
    def direct(self) -> bool:
        """Whether the runtime reduces the tensor's own memory with ``op`` (nothing to finish)."""
        return self.op is not None and self.finish is _nothing


def _nothing(*_args: Any) -> None:
    return None


def reduction(tensor: torch.Tensor, reduce_op: Any, what: str) -> Reduction:
    """The :class:`Reduction` of ``tensor`` by torch's ``reduce_op``; ``what`` names the call in errors."""
    op = _op_name(reduce_op)
    dtype = tensor.dtype
    if op in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise ValueError(f"{what}: {op.upper()} is defined for integer and bool tensors, not {dtype}")
        if dtype == torch.bool and op != "bxor":
            return reduction(tensor, dist.ReduceOp.MAX if op == "bor" else dist.ReduceOp.MIN, what)
        local = _BITWISE[op]
        return Reduction(tensor, None, functools.partial(_reduce_gathered, tensor, local))
    if dtype == torch.bool:
        if op == "avg":
            raise ValueError(f"{what}: AVG is not defined for bool tensors")
        return Reduction(tensor.view(torch.uint8), "max" if op in ("sum", "max") else "min", _nothing)
    if dtype in _SIGNED_OF:
        if op == "avg":
            raise ValueError(f"{what}: AVG is not defined for integer dtype {dtype}; use SUM and divide yourself")
        signed = tensor.view(_SIGNED_OF[dtype])
        if op in ("sum", "prod"):
            return Reduction(signed, op, _nothing)
        flipped = signed ^ _SIGN_BIT[signed.dtype]
        return Reduction(flipped, op, lambda: signed.copy_(flipped ^ _SIGN_BIT[signed.dtype]))
    if dtype not in _RUNTIME_DTYPES:
        raise ValueError(f"{what}: the allreduce backend does not reduce {dtype} tensors")
    return Reduction(tensor, op, _nothing)


def _reduce_gathered(
    tensor: torch.Tensor, local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], gathered: torch.Tensor
) -> None:
    blocks = gathered.view(-1, tensor.numel())
    tensor.copy_(functools.reduce(local, blocks.unbind(0)).view(tensor.shape))


def as_runtime_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as a dtype the runtime moves (for copies: broadcast, all-gather, scatter)."""
    if tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    if tensor.dtype in _SIGNED_OF:
        return tensor.view(_SIGNED_OF[tensor.dtype])
    if tensor.dtype not in _RUNTIME_DTYPES and not tensor.dtype.is_complex:
        raise ValueError(f"the allreduce backend does not move {tensor.dtype} tensors")
    if tensor.dtype.is_complex:
        return torch.view_as_real(tensor) if tensor.dim() else torch.view_as_real(tensor.reshape(1))
    return tensor
