"""The built-in cost models per transport: α, β, γ measured on the 2-core development machine (``allreduce tune``
measures them on yours and writes the file ``auto`` reads instead)."""

from __future__ import annotations

import os

from allreduce.schedules import CostModel

__all__ = ["SHM_FUSED_BYTES", "SHM_SHARED_CORES_STEP_S", "SHM_STEP_S", "default_cost_model"]

SHM_STEP_S = 8e-6
"""α of shm when every rank has a core: what one more step costs a call (measured at 4 KiB, N=2, 2026-12-01:
recursive doubling, 1 step, 65.9 µs; halving-doubling and ring, 2 steps, 74.2 and 76.2 µs)."""

SHM_SHARED_CORES_STEP_S = 25e-6
"""α of shm with more ranks than cores: a handoff then waits for the waiting rank to be scheduled (measured at 4 KiB,
N=4 on 2 cores, 2026-12-01: recursive doubling, 2 steps, 285 µs; halving-doubling, 4 steps, 332 µs; ring, 6
steps, 401 µs: 23-29 µs per step)."""


SHM_FUSED_BYTES = 256 << 10
"""The shm model's ``fused_bytes``: calls whose steps × size fit the eager snapshots
(:data:`~allreduce.runtime.shm.EAGER_BYTES`) are read out of a snapshot and reduced in one pass per step (measured
at N=2, 2026-12-03, recursive doubling against the ring: 0.92 of its time at 64 KiB, 0.66 at 256 KiB, in
``group.empty()`` buffers as in plain arrays; beyond the snapshots, in-place recursive doubling reduces through
scratch and lost: 1.31-4.5x the ring's time from 512 KiB to 8 MiB)."""


def default_cost_model(transport: str, world_size: int = 1) -> CostModel:
    """Built-in α, β, γ per transport (measured on the 2-core development machine; ``allreduce tune`` refines);
    shm's α is larger when ``world_size`` ranks share fewer cores (:data:`SHM_SHARED_CORES_STEP_S`)."""
    if transport == "shm":
        shared = world_size > len(os.sched_getaffinity(0))
        step_s = SHM_SHARED_CORES_STEP_S if shared else SHM_STEP_S
        return CostModel(latency_s=step_s, bandwidth_Bps=6e9, reduce_bandwidth_Bps=7e9, fused_bytes=SHM_FUSED_BYTES)
    return CostModel(latency_s=40e-6, bandwidth_Bps=2e9, reduce_bandwidth_Bps=7e9)
