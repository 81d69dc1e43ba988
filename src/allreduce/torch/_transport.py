"""Schedules over torch.distributed: a :class:`~allreduce.runtime.Transport` built on isend/irecv.

Any allreduce schedule then runs wherever torch.distributed is the engine (Gloo here, NCCL on GPU clusters):
the schedule decides who sends which block to whom at which step; torch's point-to-point calls move the bytes.

Buffers travel as raw bytes (a ``uint8`` view of the numpy buffer), so every dtype the runtime handles —
bfloat16 from ml_dtypes included, which torch cannot wrap — crosses unchanged. Receives always land in scratch
space and are reduced (or copied) into the buffer only once they have fully arrived, which gives the plan's
semantics for free (sends read the step-start state, receives land at step end) and means a peer that fails
mid-transfer never leaves half a message in the user's buffer. A receive whose range is not sent in the same
step is applied as soon as it arrives, so reducing segment k overlaps receiving segment k+1.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

import torch
from allreduce.runtime import (
    Call,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    ProtocolError,
    ReduceInto,
    Transfer,
    Transport,
    corrupted,
)

__all__ = ["TorchTransport"]

# A descriptor slot of the agreement all-gather: a 4-byte length, then the descriptor. Descriptors are a few
# dozen bytes, so one fixed-size round almost always suffices; a longer one costs a second round.
_SLOT_BYTES = 128
_LENGTH = struct.Struct("<I")

# Tags keep the pieces of one step apart: tag = step * _TAG_STEP + k for the k-th transfer between one pair
# in that step; checksums use the same layout offset by _TAG_CHECKSUM. Gloo takes 32-bit tags.
_TAG_STEP = 1 << 12
_TAG_STEPS = 1 << 18
_TAG_CHECKSUM = 1 << 30


_RELEASED: Any = None
"""What a closed transport holds instead of its torch process group."""


def _tag(step_index: int, k: int) -> int:
    return (step_index % _TAG_STEPS) * _TAG_STEP + k % _TAG_STEP


@dataclass(slots=True)
class _PendingRecv:
    transfer: Transfer
    scratch: torch.Tensor
    work: Any
    crc_tensor: torch.Tensor | None
    crc_work: Any
    staged: bool


class TorchTransport(Transport):
    """Runs compiled plans with ``torch.distributed`` point-to-point calls on an existing process group.

    ``process_group`` defaults to the default (world) group, which must already be initialised
    (``dist.init_process_group``). Ranks in plans are ranks *of that group*. The transport does not own the
    process group: ``close()`` only stops this object from being used.
    """

    name = "torch"

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchTransport needs an initialised torch.distributed: call dist.init_process_group(...) first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given torch process group")
        super().__init__(rank, dist.get_world_size(group))
        self._group = group
        self._scratch = torch.empty(0, dtype=torch.uint8)

    # ------------------------------------------------------------------------------------------------
    # Agreement: a fixed-size all-gather of raw bytes (nothing is unpickled)
    # ------------------------------------------------------------------------------------------------
    def _agree(self, seq: int, descriptor: bytes, *, deadline: float, timeout_s: float) -> list[bytes]:
        capacity = _SLOT_BYTES - _LENGTH.size
        slot = torch.zeros(_SLOT_BYTES, dtype=torch.uint8)
        head = _LENGTH.pack(len(descriptor)) + descriptor[:capacity]
        slot[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        slots = self._all_gather(slot, seq=seq, deadline=deadline, timeout_s=timeout_s)
        lengths = [_LENGTH.unpack(bytes(s[: _LENGTH.size].numpy()))[0] for s in slots]
        longest = max(lengths)
        if longest <= capacity:
            return [bytes(s[_LENGTH.size : _LENGTH.size + n].numpy()) for s, n in zip(slots, lengths, strict=True)]
        # Every rank saw the same lengths, so every rank takes this second round.
        padded = torch.zeros(longest, dtype=torch.uint8)
        if descriptor:
            padded[: len(descriptor)] = torch.frombuffer(bytearray(descriptor), dtype=torch.uint8)
        full = self._all_gather(padded, seq=seq, deadline=deadline, timeout_s=timeout_s)
        return [bytes(s[:n].numpy()) for s, n in zip(full, lengths, strict=True)]

    def _all_gather(self, local: torch.Tensor, *, seq: int, deadline: float, timeout_s: float) -> list[torch.Tensor]:
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(gathered, local, group=self._group, async_op=True)
        except RuntimeError as exc:
            raise self._fail(exc, peer=None, step=None, seq=seq, timeout_s=timeout_s, what="the agreement") from exc
        self._wait(work, peer=None, step=None, seq=seq, deadline=deadline, timeout_s=timeout_s, what="the agreement")
        return gathered

    # ------------------------------------------------------------------------------------------------
    # Execution of a compiled plan
    # ------------------------------------------------------------------------------------------------
    def _execute(self, call: Call) -> None:
        raw = torch.from_numpy(call.buffer.view(np.uint8))
        for step in call.plan.steps:
            self._run_step(call, step.index, step.sends, step.recvs, raw)

    def _run_step(
        self, call: Call, step_index: int, sends: Sequence[Transfer], recvs: Sequence[Transfer], raw: torch.Tensor
    ) -> None:
        buffer, reduce_into, seq, checksum = call.buffer, call.reduce_into, call.seq, call.checksum
        deadline, timeout_s, item = call.deadline, call.timeout_s, call.buffer.itemsize
        # Receives are posted before sends so that a peer's message finds its buffer waiting.
        scratch = self._scratch_for(sum(t.count for t in recvs) * item)
        pending: list[_PendingRecv] = []
        offset = 0
        per_peer: dict[int, int] = {}
        try:
            for t in recvs:
                k = per_peer.get(t.peer, 0)
                per_peer[t.peer] = k + 1
                nbytes = t.count * item
                target = scratch[offset : offset + nbytes]
                offset += nbytes
                work = dist.irecv(target, group=self._group, group_src=t.peer, tag=_tag(step_index, k))
                crc_tensor = crc_work = None
                if checksum:
                    crc_tensor = torch.empty(1, dtype=torch.int64)
                    crc_work = dist.irecv(
                        crc_tensor, group=self._group, group_src=t.peer, tag=_TAG_CHECKSUM + _tag(step_index, k)
                    )
                staged = any(s.start < t.stop and t.start < s.stop for s in sends)
                pending.append(_PendingRecv(t, target, work, crc_tensor, crc_work, staged))
            send_works: list[tuple[Transfer, Any]] = []
            per_peer.clear()
            for t in sends:
                k = per_peer.get(t.peer, 0)
                per_peer[t.peer] = k + 1
                view = raw[t.start * item : t.stop * item]
                send_works.append((t, dist.isend(view, group=self._group, group_dst=t.peer, tag=_tag(step_index, k))))
                if checksum:
                    crc = torch.tensor([zlib.crc32(view.numpy().data)], dtype=torch.int64)
                    send_works.append(
                        (
                            t,
                            dist.isend(
                                crc, group=self._group, group_dst=t.peer, tag=_TAG_CHECKSUM + _tag(step_index, k)
                            ),
                        )
                    )
        except RuntimeError as exc:
            raise self._fail(exc, peer=None, step=step_index, seq=seq, timeout_s=timeout_s, what="posting") from exc

        deferred: list[_PendingRecv] = []
        for p in pending:
            t = p.transfer
            self._wait(p.work, peer=t.peer, step=step_index, seq=seq, deadline=deadline, timeout_s=timeout_s)
            if p.crc_work is not None and p.crc_tensor is not None:
                self._wait(p.crc_work, peer=t.peer, step=step_index, seq=seq, deadline=deadline, timeout_s=timeout_s)
                expected = int(p.crc_tensor.item())
                got = zlib.crc32(p.scratch.numpy().data)
                if got != expected:
                    raise corrupted(
                        rank=self.rank, peer=t.peer, step=step_index, seq=seq,
                        what=f"block {t.block}, segment {t.segment}", got=got, expected=expected,
                    )  # fmt: skip
            if p.staged:
                deferred.append(p)
            else:
                self._land(p, buffer, item, reduce_into)
        for t, work in send_works:
            self._wait(work, peer=t.peer, step=step_index, seq=seq, deadline=deadline, timeout_s=timeout_s)
        for p in deferred:
            self._land(p, buffer, item, reduce_into)

    @staticmethod
    def _land(p: _PendingRecv, buffer: np.ndarray[Any, Any], item: int, reduce_into: ReduceInto) -> None:
        t = p.transfer
        incoming = p.scratch.numpy().view(buffer.dtype)
        if t.reduce:
            reduce_into(buffer[t.start : t.stop], incoming)
        else:
            buffer[t.start : t.stop] = incoming

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        # One scratch area per transport, grown on demand: a step's receives are disjoint slices of it.
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch

    # ------------------------------------------------------------------------------------------------
    # Waiting and errors
    # ------------------------------------------------------------------------------------------------
    def _wait(
        self,
        work: Any,
        *,
        peer: int | None,
        step: int | None,
        seq: int,
        deadline: float,
        timeout_s: float,
        what: str = "",
    ) -> None:
        remaining_s = max(deadline - time.monotonic(), 1e-3)
        try:
            work.wait(timeout=timedelta(seconds=remaining_s))
        except RuntimeError as exc:
            raise self._fail(exc, peer=peer, step=step, seq=seq, timeout_s=timeout_s, what=what) from exc

    def _fail(
        self, exc: RuntimeError, *, peer: int | None, step: int | None, seq: int, timeout_s: float, what: str
    ) -> CollectiveError:
        where = f" at step {step}" if step is not None else ""
        whom = f"rank {peer}" if peer is not None else "the other ranks"
        context = f" during {what}" if what else ""
        text = str(exc)
        error: CollectiveError
        if "Timed out" in text or "timed out" in text or "Timeout" in text:
            error = CollectiveTimeoutError(
                f"rank {self.rank}: collective {seq}{where}{context} timed out after {timeout_s:g} s waiting for "
                f"{whom} (torch.distributed: {text.splitlines()[0]})",
                rank=self.rank,
                peer=peer,
                step=step,
            )
        elif "closed" in text or "reset" in text or "Broken pipe" in text:
            error = PeerFailureError(
                f"rank {self.rank}: {whom} failed (connection closed) in collective {seq}{where}{context}",
                rank=self.rank,
                peer=peer,
                step=step,
            )
        else:
            error = ProtocolError(
                f"rank {self.rank}: torch.distributed failed in collective {seq}{where}{context} with {whom}: "
                f"{text.splitlines()[0] if text else type(exc).__name__}",
                rank=self.rank,
                peer=peer,
                step=step,
            )
        return error

    def _release(self) -> None:
        # The torch process group stays as it is (the caller owns it), but this transport lets go of it: a
        # reference kept here kept a destroyed Gloo group alive, its native threads with it, until interpreter
        # finalization, where a Gloo thread that then takes the GIL is ended by pthread_exit, whose unwinding
        # through a noexcept frame aborts the process ("terminate called without an active exception").
        self._group = _RELEASED
        self._scratch = torch.empty(0, dtype=torch.uint8)
