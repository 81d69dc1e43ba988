"""Monte Carlo samples re-run with the event engine (:mod:`allreduce.sim._event`): the noise the fast
engine's stepping drew, recorded per sample and transfer, replayed (ranks starting at their arrival, each
transfer delivered its recorded delay later), and the culprit found on the event engine's critical path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase, Schedule
from allreduce.schedules.timing import Blame, blame_key
from allreduce.sim._event import Transfers, match_transfers, run_core
from allreduce.sim._jit import available as kernel_available
from allreduce.sim._jit import ready as kernel_ready
from allreduce.sim._layout import Layout
from allreduce.sim._routing import Router
from allreduce.sim._simulate import AUTO_EXACT_MAX_RANKS
from allreduce.sim._tailresult import TailConfig

__all__ = [
    "DEFAULT_EXACT_BUDGET_S",
    "EVENT_S_PER_TRANSFER",
    "TAIL_EXACT_MAX_RANKS",
    "NoiseRecorder",
    "SampleRun",
    "event_transfers",
    "rerun_cost_s",
    "run_event_sample",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# engine="auto" re-runs the samples the fast engine cannot certify with the event engine when the group has at
# most TAIL_EXACT_MAX_RANKS ranks and the re-runs fit the exact budget (simulate_tail's exact_budget_s, CPU
# seconds, planned at EVENT_S_PER_TRANSFER per transfer and sample). The compiled core (sim/_kernel.py) replays
# a sample on one layout for about 1 us of CPU per transfer where noise keeps components small
# (benchmarks/bench_tail.py) and 5-6 us where many flows share links (benchmarks/bench_engines.py): 6 us plans
# for the worse. The numpy cores cost 30-80 us (rings, halving-doubling and double binary trees of 16-64 ranks
# on a fat-tree): 60 us, and 256 ranks, as before the kernel.
TAIL_EXACT_MAX_RANKS = 4096 if kernel_available() else AUTO_EXACT_MAX_RANKS
EVENT_S_PER_TRANSFER = 6e-6 if kernel_available() else 60e-6
# The default budget: a minute of re-runs.
DEFAULT_EXACT_BUDGET_S = 60.0


@dataclass(frozen=True, eq=False)
class SampleRun:
    """One event-driven run with noise (:func:`run_event_sample`): each rank's end, and the critical path
    walked back from the last one: its transfers, the rank whose delay follows each, and the rank whose
    arrival it starts from (the last rank itself when that one had no transfers)."""

    rank_end_s: FloatArray
    chain_transfers: IntArray
    chain_ranks: IntArray
    start_rank: int


def run_event_sample(
    schedule: Schedule,
    router: Router,
    transfers: Transfers,
    *,
    size_bytes: float,
    rank_delay_s: FloatArray | None,
    start_s: FloatArray,
    extra_s: FloatArray,
) -> SampleRun:
    """The event engine with ranks reaching the collective at ``start_s`` and a delay ``extra_s`` added to
    each transfer's delivery (``transfers`` in :func:`match_transfers`' order): one Monte Carlo sample."""
    # Without the kernel, the per-event core: a sample is small, where the windowed core's passes cost most.
    problem = (schedule, router, transfers, size_bytes, rank_delay_s)
    run = run_core(problem, start_s=start_s, extra_s=extra_s, windowed=False)
    return _sample_run(run, schedule, transfers)


def _sample_run(run: Layout, schedule: Schedule, transfers: Transfers) -> SampleRun:
    """A finished run's rank ends and critical path."""
    last_rank = int(np.argmax(run.rank_end)) if schedule.world_size else 0
    chain: list[int] = []
    ranks: list[int] = []
    start = -1
    slot = int(run.rank_stop_slot[last_rank]) - 1 if len(transfers) else -1
    if slot >= run.rank_first_slot[last_rank]:
        while slot >= 0:
            x = int(run.slot_last[slot])
            chain.append(x)
            ranks.append(int(run.slot_rank[slot]))
            cause = int(run.trigger[x])
            start = int(run.slot_rank[cause])
            slot = cause - 1 if cause > run.rank_first_slot[start] else -1
    else:
        start = last_rank
    return SampleRun(run.rank_end.copy(), np.asarray(chain, dtype=np.int64), np.asarray(ranks, dtype=np.int64), start)


def event_transfers(schedule: Schedule, config: TailConfig, samples: int) -> Transfers | None:
    """The schedule's transfers in the event engine's order, if some samples may be re-run with it."""
    if config.engine == "fast" or config.timed_faults:
        return None
    if config.engine == "auto" and (schedule.world_size > TAIL_EXACT_MAX_RANKS or samples < 1):
        return None
    return match_transfers(schedule)


def rerun_cost_s(transfers: int, samples: int) -> float:
    """About how many CPU seconds re-running ``samples`` samples of ``transfers`` transfers takes."""
    return transfers * samples * EVENT_S_PER_TRANSFER


def _occurrence(keys: IntArray) -> IntArray:
    """Per key, how many equal keys come before it (0 for the first of its value)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    out = np.empty_like(keys)
    out[order] = np.arange(keys.size) - np.searchsorted(ordered, ordered, side="left")
    return out


# The blame key of "no delay" (blame_key(0, -1)): every real delay's key exceeds it.
_NO_BLAME = int(blame_key(np.zeros(1), -1)[0])


class NoiseRecorder:
    """The noise the stepping method drew, per sample and event-engine transfer, for samples re-run with the
    event engine: the delay added to each transfer (losses, link jitter) and the blame key of its largest
    part. Phase ``p``'s flow ``f`` at its ``j``-th step is transfer ``index[p][j, f]``: the k-th transfer from
    a to b at a step is the k-th such flow of the phase."""

    def __init__(self, schedule: Schedule, transfers: Transfers, phases: list[Phase], *, dense: bool) -> None:
        self.schedule = schedule
        self.transfers = transfers
        self.dense = dense
        n = schedule.world_size
        t = transfers
        keys = (t.step.astype(np.int64) * n + t.src) * n + t.dst
        occurrence = _occurrence(keys)
        width = int(occurrence.max()) + 1 if occurrence.size else 1
        combined = keys * width + occurrence
        order = np.argsort(combined)
        ordered = combined[order]
        self.index: list[IntArray] = []
        for phase in phases:
            steps = phase.first_step + np.arange(phase.repeat, dtype=np.int64)
            flow_keys = (steps[:, None] * n + phase.src[None, :]) * n + phase.dst[None, :]
            wanted = flow_keys * width + _occurrence(phase.src * n + phase.dst)[None, :]
            at = np.minimum(np.searchsorted(ordered, wanted), max(ordered.size - 1, 0))
            if (ordered.size == 0 and wanted.size) or not np.array_equal(ordered[at], wanted):
                raise AssertionError(f"{schedule.name}: a phase's flows do not match the event engine's transfers")
            self.index.append(order[at])
        self._sample: list[IntArray] = []
        self._transfer: list[IntArray] = []
        self._seconds: list[FloatArray] = []
        self._key: list[IntArray] = []

    def add(
        self,
        phase_index: int,
        j: int,
        cols: IntArray,
        *,
        extra: FloatArray | None,
        extra_key: IntArray | None,
        sparse: tuple[IntArray, IntArray, FloatArray, IntArray | None] | None,
    ) -> None:
        """The delays of step ``j`` of a phase: ``extra`` (flows x samples of ``cols``) and ``sparse``."""
        ids = self.index[phase_index][j]
        if extra is not None and self.dense:
            shape = extra.shape
            self._sample.append(np.broadcast_to(cols[None, :], shape).ravel())
            self._transfer.append(np.broadcast_to(ids[:, None], shape).ravel())
            self._seconds.append(extra.ravel())
            self._key.append(np.full(extra.size, _NO_BLAME) if extra_key is None else extra_key.ravel())
        if sparse is not None:
            flow, sample, seconds, key = sparse
            self._sample.append(cols[sample])
            self._transfer.append(ids[flow])
            self._seconds.append(seconds)
            self._key.append(np.full(seconds.size, _NO_BLAME) if key is None else key)

    def rerun(
        self,
        samples: IntArray,
        router: Router,
        *,
        size_bytes: float,
        rank_delay: FloatArray | None,
        arrival: FloatArray,
        attribution: bool,
        out: tuple[FloatArray, IntArray, FloatArray],
    ) -> None:
        """Run ``samples`` with the event engine and their recorded noise; write their step time (and, with
        ``attribution``, the culprit of the largest single delay on the event engine's critical path) to
        ``out``."""
        step_s, culprit, culprit_s = out
        count = len(self.transfers)
        empty_i = np.zeros(0, dtype=np.int64)
        sample = np.concatenate(self._sample) if self._sample else empty_i
        transfer = np.concatenate(self._transfer) if self._transfer else empty_i
        seconds = np.concatenate(self._seconds) if self._seconds else np.zeros(0)
        key = np.concatenate(self._key) if self._key else empty_i
        order = np.argsort(sample, kind="stable")
        sample, transfer, seconds, key = sample[order], transfer[order], seconds[order], key[order]
        # The compiled core runs every sample on one layout (routes and slots built once).
        prepared = None
        if kernel_ready() and count and samples.size:
            from allreduce.sim._kernel import run_kernel  # numba loads with the first run that needs it

            prepared = Layout(self.schedule, router, self.transfers, size_bytes, rank_delay)
        for s in samples.tolist():
            lo, hi = np.searchsorted(sample, [s, s + 1])
            extra = np.zeros(count)
            np.add.at(extra, transfer[lo:hi], seconds[lo:hi])
            if prepared is not None:
                prepared.replay(arrival[:, s], extra)
                run_kernel(prepared)
                run = _sample_run(prepared, self.schedule, self.transfers)
            else:
                run = run_event_sample(
                    self.schedule,
                    router,
                    self.transfers,
                    size_bytes=size_bytes,
                    rank_delay_s=rank_delay,
                    start_s=arrival[:, s],
                    extra_s=extra,
                )
            step_s[s] = float(run.rank_end_s.max())
            if not attribution:
                continue
            keys = np.full(count, _NO_BLAME, dtype=np.int64)
            np.maximum.at(keys, transfer[lo:hi], key[lo:hi])
            best = _NO_BLAME
            if run.chain_transfers.size:
                best = max(best, int(keys[run.chain_transfers].max()))
            if rank_delay is not None and run.chain_ranks.size:
                ranks = run.chain_ranks
                best = max(best, int(blame_key(rank_delay[ranks], ranks).max()))
            start = run.start_rank
            if start >= 0 and arrival[start, s] > 0:
                best = max(best, int(blame_key(np.asarray([arrival[start, s]]), start)[0]))
            final = Blame(np.asarray([[best]], dtype=np.int64))
            culprit[s] = int(final.culprit[0, 0])
            culprit_s[s] = float(final.seconds[0, 0])
