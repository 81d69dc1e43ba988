"""Per phase of a tail simulation: the flows' noise-free durations, loss probabilities and connections, and the
lost transfers drawn for them (which transfers lose packets and what each loss costs); the runtime's agreement
messages and their losses; the loss rates no stack recovers from, refused.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import numpy.typing as npt

from allreduce.schedules import Phase, Schedule
from allreduce.schedules.timing import Incidence
from allreduce.sim._bursts import Bursts, first_loss, gilbert_elliott
from allreduce.sim._cyclic import Cyclic
from allreduce.sim._fast import phase_steps
from allreduce.sim._loss import GIVE_UP_AFTER, LossModel, draw_extra_seconds, packet_loss_probability
from allreduce.sim._routing import Pattern, Router
from allreduce.sim._tcp import LostTransfers, draw_held_ack_seconds
from allreduce.sim._tcp_stall import StallPacing, ack_stall_flights, draw_ack_stall_seconds
from allreduce.sim._tcp_window import loss_window_packets
from allreduce.topology import FloatArray, IntArray, Routes

__all__ = [
    "AGREEMENT_FRAME_BYTES",
    "Losses",
    "PhaseData",
    "agreement_delays",
    "check_recoverable",
    "draw_losses",
    "phase_data",
]

# Geometric gaps drawn at once when placing lost transfers (bounds the memory of a very lossy run: 128 MiB).
_MAX_GAPS_PER_DRAW = 2**24


@dataclass(frozen=True, eq=False)
class PhaseData:
    phase: Phase
    incidence: Incidence
    seconds: FloatArray  # noise-free duration per flow
    pattern: Pattern
    nbytes: FloatArray
    loss_q: FloatArray  # per-packet loss probability per flow
    loss_hazard: FloatArray  # per route entry
    blame_link: IntArray  # the link a flow's jitter is blamed on (its bottleneck, else its first link; -1)
    cyclic: Cyclic | None  # the phase is a cyclic shift of the ranks: stepped with slices (see _step_cyclic)
    ack_q: FloatArray | None = None  # per flow: loss probability of a packet on the way back (its ACKs)
    follow_gap_s: FloatArray | None = None  # per flow: after its last step, when the connection's next transfer
    two_way: npt.NDArray[np.bool_] | None = None  # per flow: its receiver sends data back in the same step
    # the collective's last phase: the routes of the frames every rank sends first in the next collective's
    # barrier (rank s to s - 1), which cross the links while a lost tail of its last step is waited for
    next_frames: Routes | None = None

    @cached_property
    def hazard_cumulative(self) -> FloatArray:
        """The route entries' loss hazards summed in entry order (every sample group draws culprits from it)."""
        return np.cumsum(self.loss_hazard)

    @cached_property
    def flow_hazard(self) -> FloatArray:
        """Per flow, the loss hazard of its whole path."""
        hazard = np.bincount(self.pattern.entry_flow, weights=self.loss_hazard, minlength=len(self.phase))
        return np.asarray(hazard, dtype=np.float64)


def phase_data(
    schedule: Schedule,
    router: Router,
    size_bytes: float,
    link_loss: FloatArray,
    *,
    connections: bool = False,
    next_barrier: bool = False,
) -> list[PhaseData]:
    """Per phase, the flows' noise-free durations and loss probabilities; with ``connections`` (a RACK-TLP
    stack) also the loss probability of their ACKs and when each connection carries its next transfer, and with
    ``next_barrier`` too the routes of the next barrier's first frames (``PhaseData.next_frames``)."""
    out = []
    n = schedule.world_size
    for phase in schedule.phases():
        pattern = router.pattern(phase.src, phase.dst)
        nbytes = phase.fraction * size_bytes
        seconds = pattern.routes.latency_s + pattern.transfer_seconds(nbytes)
        q, hazard = packet_loss_probability(pattern.routes, link_loss)
        first = np.full(len(phase), -1, dtype=np.int64)
        has = np.diff(pattern.routes.flow_ptr) > 0
        first[has] = pattern.routes.link[pattern.routes.flow_ptr[:-1][has]]
        blame = np.where(pattern.bottleneck_link >= 0, pattern.bottleneck_link, first)
        steps = phase_steps(n, phase)
        ack_q = two_way = None
        if connections:
            # the reverse pattern, not just its routes: routers share patterns (see Router)
            ack_q, _ = packet_loss_probability(router.pattern(phase.dst, phase.src).routes, link_loss)
            two_way = _two_way(n, phase)
        data = PhaseData(phase, steps.incidence, seconds, pattern, nbytes, q, hazard, blame, steps.cyclic, ack_q)
        out.append(replace(data, two_way=two_way))
    if connections:
        out = _with_follow_gaps(schedule, out)
        if out and next_barrier:
            src = np.arange(n, dtype=np.int64)
            out[-1] = replace(out[-1], next_frames=router.pattern(src, (src - 1) % n).routes)
    return out


# Per phase object (a schedule keeps its phases): which of its flows' receivers send back to their sender in it.
_TWO_WAY: weakref.WeakKeyDictionary[Phase, tuple[int, npt.NDArray[np.bool_]]] = weakref.WeakKeyDictionary()


def _two_way(world_size: int, phase: Phase) -> npt.NDArray[np.bool_]:
    """Per flow of ``phase``, whether its receiver sends data back to its sender in the same step; computed once
    per phase (every tail of a plan's loss rows asks for every phase)."""
    known = _TWO_WAY.get(phase)
    if known is not None and known[0] == world_size:
        return known[1]
    key = phase.src.astype(np.int64) * world_size + phase.dst
    two_way = np.isin(phase.dst.astype(np.int64) * world_size + phase.src, key)
    two_way.flags.writeable = False  # every tail's phase data shares it
    _TWO_WAY[phase] = (world_size, two_way)
    return two_way


def _with_follow_gaps(schedule: Schedule, data: list[PhaseData]) -> list[PhaseData]:
    """For every flow, how long after its phase's last step the same connection (sender to receiver) carries
    its next transfer: the noise-free durations of the steps in between (each as long as its longest flow, the
    lockstep view; the sender writes the next transfer as soon as it reaches that step); inf if none does.
    Within a phase of several steps the next step's transfer follows at once (gap 0)."""
    out = []
    step_s = [float(d.seconds.max(initial=0.0)) * d.phase.repeat for d in data]
    for i, (d, following) in enumerate(zip(data, _next_phase(schedule, [d.phase for d in data]), strict=True)):
        # between[j]: the steps of phases i+1 .. j-1, summed in that order
        between = np.full(len(data) + 1, math.inf)
        total = 0.0
        for j in range(i + 1, len(data)):
            between[j] = total
            total += step_s[j]
        out.append(replace(d, follow_gap_s=between[following]))
    return out


# Per schedule: for every flow of every phase, the next phase in which its connection carries a transfer.
_NEXT_PHASE: weakref.WeakKeyDictionary[Schedule, list[IntArray]] = weakref.WeakKeyDictionary()


def _next_phase(schedule: Schedule, phases: list[Phase]) -> list[IntArray]:
    """Per phase, for each of its flows, the first later phase with a flow of the same sender and receiver (the
    number of phases if none), computed once per schedule."""
    known = _NEXT_PHASE.get(schedule)
    if known is not None and [k.size for k in known] == [len(p) for p in phases]:
        return known
    connections = _Connections(schedule.world_size, phases)
    following = connections.first_phase(connections.keys, connections.index + 1)
    bounds = np.cumsum([0] + [len(p) for p in phases])
    result = [following[bounds[i] : bounds[i + 1]] for i in range(len(phases))]
    _NEXT_PHASE[schedule] = result
    return result


class _Connections:
    """Every flow of ``phases`` as its connection (sender * world_size + receiver) and phase, sorted
    connection-major, phase-minor: the first phase at or after a given one with a flow on a connection is then
    one search."""

    def __init__(self, world_size: int, phases: list[Phase]) -> None:
        self.count = len(phases)
        self.index = np.repeat(np.arange(self.count, dtype=np.int64), [len(p) for p in phases])
        self.keys = (
            np.concatenate([p.src.astype(np.int64) * world_size + p.dst for p in phases]) if phases else self.index
        )
        self.ordered = np.sort(self.keys * (self.count + 1) + self.index)

    def first_phase(self, key: IntArray, earliest: IntArray | int) -> IntArray:
        """For each connection ``key``, the first phase at or after ``earliest`` with a flow on it (the number of
        phases if none)."""
        span = self.count + 1
        if not self.ordered.size:
            return np.full(key.size, self.count, dtype=np.int64)
        at = np.searchsorted(self.ordered, key * span + earliest, side="left")
        found = self.ordered[np.minimum(at, self.ordered.size - 1)]
        same = (at < self.ordered.size) & (found // span == key)
        return np.where(same, found % span, self.count)


@dataclass(frozen=True, eq=False)
class Losses:
    """A phase's lost transfers in a chunk of samples, sorted by step."""

    step: IntArray
    flow: IntArray
    sample: IntArray
    extra_s: FloatArray
    link: IntArray
    timeouts: IntArray

    def bounds(self, repeat: int) -> IntArray:
        return np.searchsorted(self.step, np.arange(repeat + 1))


def _draw_transfers(
    rng: np.random.Generator, transfer_p: FloatArray, repeat: int, samples: int
) -> tuple[IntArray, IntArray, IntArray]:
    """Which of ``repeat x flows x samples`` transfers an event with per-flow probability ``transfer_p`` befalls
    (thinning from the largest probability, over geometric gaps: exact and O(events)): (step, flow, sample)."""
    none = np.zeros(0, dtype=np.int64)
    top = float(transfer_p.max()) if transfer_p.size else 0.0
    if top <= 0:
        return none, none, none
    flows = transfer_p.size
    total = repeat * flows * samples
    expected = top * total
    positions: list[IntArray] = []
    last = -1
    while last < total:
        batch = min(int(expected + 6 * math.sqrt(expected) + 16), _MAX_GAPS_PER_DRAW)
        gaps = rng.geometric(top, size=batch).astype(np.int64)
        at = last + np.cumsum(gaps)
        positions.append(at[at < total])
        last = int(at[-1])
    index = np.concatenate(positions)
    flow = (index // samples) % flows
    keep = rng.random(index.size) < transfer_p[flow] / top
    index, flow = index[keep], flow[keep]
    return index // (samples * flows), flow, index % samples


def draw_losses(rng: np.random.Generator, model: LossModel, d: PhaseData, samples: int) -> Losses:
    """Which transfers of ``repeat x flows x samples`` lose packets, and what each loss costs; on a RACK-TLP
    stack also which lose the last ACK of a flight with nothing behind it (:func:`_ack_stalls`). Where a burst
    holds the link of a lost tail of the collective's last step and repetitions are timed from a barrier, the
    next barrier's first frames that cross it before the probe are counted (:func:`_frames_crossing`)."""
    mtu = model.mtu
    packets = np.ceil(d.nbytes / mtu).astype(np.int64)
    q = d.loss_q
    bursts = _bursts(model, d)
    with np.errstate(divide="ignore"):
        if bursts is None:
            transfer_p = np.where(packets > 0, -np.expm1(packets * np.log1p(-q)), 0.0)
        else:  # the first packet lost at the long-run rate, the others only by a burst starting
            keep = np.log1p(-q) + (packets - 1) * np.log1p(-bursts.entry_q)
            transfer_p = np.where(packets > 0, -np.expm1(keep), 0.0)
    step, flow, sample = _draw_transfers(rng, transfer_p, d.phase.repeat, samples)
    rate = d.pattern.rate_Bps[flow]
    packet_s = np.where(np.isfinite(rate), mtu / rate, 0.0)
    rtt = 2 * d.pattern.routes.latency_s[flow]
    gap = None
    if d.follow_gap_s is not None:
        gap = np.where(step < d.phase.repeat - 1, 0.0, d.follow_gap_s[flow])
    culprit = cleared = None
    if bursts is not None and model.held_bursts and d.next_frames is not None:
        culprit = _culprit_links(rng, d, flow)
        cleared = np.where(step == d.phase.repeat - 1, _frames_crossing(d.next_frames, d.phase.dst[flow], culprit), 0)
    extra, timeout = draw_extra_seconds(
        rng,
        model,
        LostTransfers(
            q[flow],
            packets[flow],
            rtt,
            packet_s,
            q_ack=None if d.ack_q is None else d.ack_q[flow],
            gap_s=gap,
            bursts=None
            if bursts is None
            else Bursts(bursts.entry_q[flow], bursts.stay[flow], bursts.hold_s, cleared=cleared),
        ),
    )
    losses = Losses(step, flow, sample, extra, _culprit_links(rng, d, flow) if culprit is None else culprit, timeout)
    if d.ack_q is not None and model.rack_tlp and model.stack.gro:
        losses = _merge(losses, _ack_stalls(rng, model, d, packets, samples))
    return losses


def _bursts(model: LossModel, d: PhaseData) -> Bursts | None:
    """Per flow, how its losses cluster when every lossy link drops in bursts of ``model.burst`` packets
    (:func:`allreduce.sim._bursts.gilbert_elliott` per link; a burst starts on the path where one starts on any of
    its links); None for independent loss."""
    return _path_bursts(model, d.pattern.routes, d.loss_hazard)


def _path_bursts(model: LossModel, routes: Routes, loss_hazard: FloatArray) -> Bursts | None:
    if model.burst <= 1:
        return None
    weight = np.where(routes.weight > 0, routes.weight, 1.0)
    link_p = -np.expm1(-loss_hazard / weight)
    entry, _ = gilbert_elliott(link_p, model.burst)
    hazard = -routes.weight * np.log1p(-entry)
    entry_q = -np.expm1(-np.bincount(routes.flow_of_entry(), weights=hazard, minlength=routes.num_flows))
    return Bursts(entry_q, (1 - 1 / model.burst) + entry_q / model.burst, model.burst_hold_s)


def _frames_crossing(frames: Routes, waiting: IntArray, link: IntArray) -> FloatArray:
    """Per lost tail of the collective's last step, held by a burst on ``link`` while rank ``waiting`` waits for
    it: the packets of the next barrier's first frames (``frames``, rank s to s − 1, one segment each) that cross
    ``link``. Only the waiting rank is held there (no one waits for it after the last step), so every other rank
    finishes and sends its frame at once, well before the probe (``2·srtt`` or more); a lower bound on the link's
    packets, as the ACKs of the collective's other flows ending with it and the barrier's later steps are left
    out."""
    # a frame sprayed over several paths crosses each with its share of the packets
    share = np.where(frames.weight > 0, frames.weight, 1.0)
    span = int(max(frames.link.max(initial=0), link.max(initial=0))) + 1
    crossing = np.bincount(frames.link, weights=share, minlength=span)[link]
    keys, inverse = np.unique(frames.flow_of_entry() * span + frames.link, return_inverse=True)
    if keys.size == 0:
        return np.zeros(link.size)
    own = np.bincount(inverse, weights=share, minlength=keys.size)
    key = waiting * span + link
    at = np.minimum(np.searchsorted(keys, key), keys.size - 1)
    return np.asarray(crossing - np.where(keys[at] == key, own[at], 0.0), dtype=np.float64)


def _culprit_links(rng: np.random.Generator, d: PhaseData, flow: IntArray) -> IntArray:
    """Per lost transfer of ``flow``, the link that dropped its (first) lost packet: drawn in proportion to each
    path link's hazard."""
    return _draw_links(rng, d.pattern.routes, d.hazard_cumulative, d.flow_hazard, flow)


def _draw_links(
    rng: np.random.Generator, routes: Routes, cumulative: FloatArray, flow_hazard: FloatArray, flow: IntArray
) -> IntArray:
    """Per entry of ``flow``, one link of its path, drawn in proportion to the route entries' hazards (summed in
    entry order: ``cumulative``; per flow: ``flow_hazard``)."""
    before = np.concatenate([[0.0], cumulative])[routes.flow_ptr[flow]]
    own = flow_hazard[flow]
    entry = np.searchsorted(cumulative, before + rng.random(flow.size) * own, side="right")
    entry = np.clip(entry, routes.flow_ptr[flow], routes.flow_ptr[flow + 1] - 1)
    return np.asarray(routes.link[entry], dtype=np.int64)


def _stall_pacing(
    rng: np.random.Generator, first: IntArray, flights: IntArray, *, q_ack: FloatArray, packets: IntArray,
    window: FloatArray, packet_s: FloatArray,
) -> tuple[IntArray, StallPacing]:  # fmt: skip
    """Which of a transfer's ``flights`` stalling flights (all but its last, :func:`ack_stall_flights`) lose
    their ending ACK, the first at ``first`` and each later one with ``q_ack``, and the segments each stall's pacing
    covers: up to the next stall's flight, ``(next − at)·W``, or the rest of the transfer, ``P − (at + 1)·W``.
    Returns (the stalls per transfer, their :class:`StallPacing`)."""
    at = [first]
    while True:
        after = at[-1] + rng.geometric(q_ack).astype(np.int64)
        if not np.any(after < flights):
            break
        at.append(np.where(after < flights, after, flights))
    stalled = np.stack(at, axis=1)
    valid = stalled < flights[:, None]
    follows = np.concatenate([stalled[:, 1:], flights[:, None]], axis=1)
    size = np.maximum(window, 1.0)[:, None]
    last = packets[:, None] - (stalled + 1) * size
    segments = np.where(valid, np.where(follows < flights[:, None], (follows - stalled) * size, last), 0.0)
    return valid.sum(axis=1), StallPacing(segments, window, packet_s)


def _ack_stalls(rng: np.random.Generator, model: LossModel, d: PhaseData, packets: IntArray, samples: int) -> Losses:
    """The transfers that lose the last ACK of a flight with more to send (:func:`ack_stall_flights` flights
    each, the ACK lost with the reverse path's probability) and what the probe and the delayed ACK cost them
    (:func:`draw_ack_stall_seconds`); blamed on the flow's bottleneck (or first) link. None where the receiver
    sends data back on the same connection in the same step (a pairwise exchange): every segment carries the
    cumulative ACK (RFC 9293 §3.4), so its next data segment repeats what a lost ACK said."""
    assert d.ack_q is not None
    bursts = _bursts(model, d)
    # CUBIC cuts its window once per recovery: once per burst
    loss_q = d.loss_q if bursts is None else bursts.entry_q
    flights = ack_stall_flights(loss_q, packets, model.mtu)
    if d.two_way is not None:
        flights = np.where(d.two_way, 0, flights)
    with np.errstate(divide="ignore"):
        stall_p = np.where(flights > 0, -np.expm1(flights * np.log1p(-d.ack_q)), 0.0)
    step, flow, sample = _draw_transfers(rng, stall_p, d.phase.repeat, samples)
    # The first lost flight-ending ACK, then any of the flights after it, and the segments paced after each.
    first = first_loss(rng, d.ack_q[flow], flights[flow])
    rate = d.pattern.rate_Bps[flow]
    stalls, paced = _stall_pacing(rng, first, flights[flow], q_ack=d.ack_q[flow], packets=packets[flow],
                                 window=loss_window_packets(loss_q)[flow],
                                 packet_s=np.where(np.isfinite(rate), model.mtu / rate, 0.0))  # fmt: skip
    extra, timeouts = draw_ack_stall_seconds(
        rng,
        model.stack,
        stalls=stalls,
        rtt_s=2 * d.pattern.routes.latency_s[flow],
        q=d.loss_q[flow],
        q_ack=d.ack_q[flow],
        paced=paced,
    )
    return Losses(step, flow, sample, extra, d.blame_link[flow], timeouts)


def _merge(a: Losses, b: Losses) -> Losses:
    """Two sets of a phase's delayed transfers as one, sorted by step (a transfer in both is delayed by both)."""
    if b.step.size == 0:
        return a
    step = np.concatenate([a.step, b.step])
    order = np.argsort(step, kind="stable")
    return Losses(
        step[order],
        np.concatenate([a.flow, b.flow])[order],
        np.concatenate([a.sample, b.sample])[order],
        np.concatenate([a.extra_s, b.extra_s])[order],
        np.concatenate([a.link, b.link])[order],
        np.concatenate([a.timeouts, b.timeouts])[order],
    )


# Expected give-ups (a packet or a go-back-N run lost GIVE_UP_AFTER + 1 times in a row) over a whole run
# above which the model refuses: it would be describing a collective that fails.
_MAX_EXPECTED_GIVE_UPS = 0.01


def check_recoverable(data: list[PhaseData], model: LossModel, samples: int) -> None:
    """Refuse a loss rate at which real stacks give up: a TCP packet lost again and again (Linux closes the
    connection after ``tcp_retries2`` = 15 timeouts), a go-back-N run that keeps losing a packet (an InfiniBand
    QP errors out after ``retry_cnt`` <= 7 retries). The model stops drawing after GIVE_UP_AFTER failures in a
    row; where that would happen at all often in these samples, its times would be made up."""
    worst = 0.0
    culprit = ""
    for d in data:
        packets = np.ceil(d.nbytes / model.mtu)
        with np.errstate(divide="ignore"):
            if model.fabric == "tcp":
                fail = d.loss_q
                attempts = packets
            else:
                fail = np.where(packets > 0, -np.expm1(packets * np.log1p(-d.loss_q)), 0.0)
                attempts = np.ones_like(packets)
            expected = d.phase.repeat * samples * attempts * fail ** (GIVE_UP_AFTER + 1)
        total = float(expected.sum())
        if total > worst:
            worst = total
            f = int(np.argmax(expected))
            what = "a packet" if model.fabric == "tcp" else f"the transfer ({int(packets[f]):,} packets)"
            culprit = (
                f"rank {int(d.phase.src[f])} -> {int(d.phase.dst[f])} loses {what} with probability "
                f"{float(fail[f]):.3g}"
            )
    if worst > _MAX_EXPECTED_GIVE_UPS:
        raise ValueError(
            f"loss: too lossy to recover from: {culprit}, so about {worst:.3g} times in these samples one would "
            f"be lost {GIVE_UP_AFTER + 1} times in a row, where a real stack gives up and the collective fails "
            "(Linux: tcp_retries2=15 timeouts; InfiniBand: retry_cnt <= 7); the model describes recovery, not "
            "failure: lower the loss probability"
        )


# The runtime's agreement frame on the wire: a frame header and one collective's descriptor (bytes of payload).
AGREEMENT_FRAME_BYTES = 208


@dataclass(frozen=True, eq=False)
class _AgreementStep:
    """One step of the agreement's all-gather: rank r sends ``packets`` to ``dst[r]`` over ``pattern``, whose
    flows lose a packet with ``q`` (route-entry hazards ``hazard``); the step takes ``seconds`` noise-free;
    ``small``: the packets are small segments (:class:`allreduce.sim._tcp.LostTransfers`)."""

    dst: IntArray
    pattern: Pattern
    q: FloatArray
    hazard: FloatArray
    packets: IntArray
    seconds: float
    small: bool


def _agreement_steps(router: Router, model: LossModel, link_loss: FloatArray) -> list[_AgreementStep]:
    n = router.rank_gpu.size
    src = np.arange(n, dtype=np.int64)
    out = []
    distance = 1
    while distance < n:
        dst = (src - distance) % n
        pattern = router.pattern(src, dst)
        q, hazard = packet_loss_probability(pattern.routes, link_loss)
        # One sendmsg per frame with TCP_NODELAY: the first leaves alone at once, and the frames written while it
        # is out join the queued segment's tail (tcp_sendmsg appends to the last unsent skb) up to an MTU.
        frames = min(distance, n - distance)
        nbytes = frames * AGREEMENT_FRAME_BYTES
        seconds = pattern.routes.latency_s + pattern.transfer_seconds(np.full(n, float(nbytes)))
        packets = np.full(n, min(frames, 1 + math.ceil((nbytes - AGREEMENT_FRAME_BYTES) / model.mtu)), dtype=np.int64)
        # at most one full segment before the last: an interactive receiver holds its ACK (__tcp_ack_snd_check)
        small = nbytes - AGREEMENT_FRAME_BYTES <= model.mtu
        out.append(_AgreementStep(dst, pattern, q, hazard, packets, float(seconds.max(initial=0.0)), small))
        distance *= 2
    return out


def _data_follow_gaps(world_size: int, steps: list[_AgreementStep], data: Sequence[PhaseData]) -> list[FloatArray]:
    """Per agreement step, per sender: how long after its frame the same connection (sender to receiver) carries
    the collective's data: the agreement's later steps, then the data phases before the first that sends on that
    connection (each step as long as its longest flow, as :func:`_with_follow_gaps`); inf if none does."""
    count = len(data)
    connections = _Connections(world_size, [d.phase for d in data])
    step_s = [float(d.seconds.max(initial=0.0)) * d.phase.repeat for d in data]
    src = np.arange(world_size, dtype=np.int64)
    out = []
    for s, step in enumerate(steps):
        # before[j]: the later agreement steps, then the data phases 0 .. j-1, summed in that order
        before = np.full(count + 1, math.inf)
        between = sum(later.seconds for later in steps[s + 1 :])
        for j in range(count):
            before[j] = between
            between += step_s[j]
        out.append(before[connections.first_phase(src * world_size + step.dst, 0)])
    return out


def agreement_delays(
    rng: np.random.Generator,
    router: Router,
    samples: int,
    model: LossModel,
    link_loss: FloatArray,
    *,
    data: Sequence[PhaseData] = (),
) -> tuple[FloatArray, IntArray, IntArray, IntArray]:
    """What lost agreement messages cost each rank, per sample. The runtime agrees on every collective first:
    an all-gather of small frames in ceil(log2 N) steps (Bruck's), in which rank r sends ``min(d, N − d)``
    frames to rank ``r − d`` for d = 1, 2, 4, ... The receiver of a lost frame waits for it (it starts the
    data that much later: the largest delay of its messages; a rank two lost messages hold back in sequence,
    probability q², is charged the larger), and what repairs it is
    :func:`allreduce.sim._tcp.draw_repair_seconds`'s: the one-packet probe (``2·srtt + rto_min``) unless the
    same connection carries a later message first, whose SACK reveals the hole (RACK marks it lost at once:
    it was sent more than the reordering window before the SACKed one).

    The sender does not wait for the rank it sends to: in Bruck's all-gather on N = 2^K ranks, rank r's final
    set holds from rank ``r + m`` only what that rank sent at step ``lowbit(m)``, and for the receiver of r's
    step-s frame (``m = N − 2^s``) that is its own step-s frame, which it sends before it waits (other N are
    charged the same way). So rank r
    finishes its all-gather, and its next frame to ``r − d`` is the next all-gather's frame of the same step:
    with ``model.barrier`` (a barrier's all-gather, then the collective's) a lost barrier frame is revealed
    ``K − 1`` small steps later; a lost frame of the collective's own agreement is revealed only by the
    collective's data on the same connection (``data``, the collective's phases: halving-doubling sends on
    ``r → r − 2^s``, a ring on none of them for N > 2), else it waits for the probe. A rank's delays in the
    two all-gathers add up. On bursty links (:func:`allreduce.sim._bursts.gilbert_elliott`, a chain clocked by
    the link's packets, as the emulator's firewall runs it) a frame is lost only where a burst starts at it,
    ``g`` (about ``p/burst``), not at the long-run ``p``: it crosses its link behind a delivered packet (the
    step's before it, or the previous collective's last, which that collective waited for), which left the
    chain good; and where that chain holds a silent link (``model.held_bursts``), the barrier's first frame that
    rides the path of a final ACK the burst took is charged too (:func:`_held_final_acks`). Returns (delay, blame
    code: world_size + the link that dropped it, lost messages per sample, timeouts per sample)."""
    n = router.rank_gpu.size
    code = np.full((n, samples), -1, dtype=np.int64)
    lost = np.zeros(samples, dtype=np.int64)
    timeouts = np.zeros(samples, dtype=np.int64)
    total = np.zeros((n, samples))
    steps = _agreement_steps(router, model, link_loss)
    whole = sum(step.seconds for step in steps)
    rounds = 2 if model.barrier else 1
    for round_ in range(rounds):
        if round_ < rounds - 1:
            gaps = [np.full(n, whole - step.seconds) for step in steps]
        else:
            gaps = _data_follow_gaps(n, steps, data)
        delay = np.zeros((n, samples))
        for step, gap in zip(steps, gaps, strict=True):
            _lost_frames(rng, step, gap, model=model, delay=delay, code=code, lost=lost, timeouts=timeouts)
        if round_ < rounds - 1 and model.held_bursts and data and steps:
            _held_final_acks(rng, steps[0], data[-1], model=model, delay=delay, code=code, lost=lost, timeouts=timeouts)
        total += delay
    return total, code, lost, timeouts


def _lost_frames(
    rng: np.random.Generator,
    step: _AgreementStep,
    gap: FloatArray,
    *,
    model: LossModel,
    delay: FloatArray,
    code: IntArray,
    lost: IntArray,
    timeouts: IntArray,
) -> None:
    """One agreement step's lost frames (see :func:`agreement_delays`), ``gap``: per sender, when after its frame
    the connection carries its next message. A receiver's ``delay`` (per rank and sample) is the largest of its
    all-gather's, and the blame of that delay goes into ``code``; the counts go into ``lost`` and ``timeouts``."""
    n, samples = code.shape
    pattern = step.pattern
    bursts = _path_bursts(model, pattern.routes, step.hazard)
    # A frame crosses its link behind a delivered packet (the step's or the collective's before it, which the
    # collective waited for), which left the chain good: on bursty links it starts a burst with g, not p.
    start_q = step.q if bursts is None else bursts.entry_q
    message_p = -np.expm1(step.packets * np.log1p(-start_q))
    flow, sample = np.nonzero(rng.random((n, samples)) < message_p[:, None])
    if flow.size == 0:
        return
    rate = pattern.rate_Bps[flow]
    extra, fired = draw_extra_seconds(
        rng,
        model,
        LostTransfers(
            step.q[flow],
            step.packets[flow],
            2 * pattern.routes.latency_s[flow],
            np.where(np.isfinite(rate), model.mtu / rate, 0.0),
            gap_s=gap[flow],
            bursts=None if bursts is None else Bursts(bursts.entry_q[flow], bursts.stay[flow], bursts.hold_s),
            small=step.small,
        ),
    )
    # Blamed on the path's lossiest link.
    routes = pattern.routes
    worst = np.full(n, -1, dtype=np.int64)
    for f in np.unique(flow):
        lo, hi = routes.flow_ptr[f], routes.flow_ptr[f + 1]
        if hi > lo:
            worst[f] = routes.link[lo + int(np.argmax(step.hazard[lo:hi]))]
    receiver = step.dst[flow]
    larger = extra > delay[receiver, sample]
    delay[receiver[larger], sample[larger]] = extra[larger]
    code[receiver[larger], sample[larger]] = n + worst[flow[larger]]
    np.add.at(lost, sample, 1)
    np.add.at(timeouts, sample, fired)


def _held_final_acks(
    rng: np.random.Generator, step: _AgreementStep, last: PhaseData, *, model: LossModel, delay: FloatArray,
    code: IntArray, lost: IntArray, timeouts: IntArray,
) -> None:  # fmt: skip
    """The barrier's first frames (``step``, rank d to d − 1, sent at once) that ride the ACK path of a connection
    whose last transfer ended the collective before (``last``, its last phase: d − 1 sent to d, and d sent nothing
    back in it): where a burst starting at that transfer's final ACK (``g`` on the frame's path, the same route)
    holds a link of it, the frame follows the lost ACK, and what it costs its receiver is
    :func:`allreduce.sim._tcp.draw_held_ack_seconds`'s, with the other ranks' first frames that cross that link
    (:func:`_frames_crossing`). The previous collective's final ACKs are drawn with this sample's barrier: the
    repetitions are alike, so the draw is the one the previous repetition would make. Adds into the barrier
    round's ``delay`` and blame ``code`` (the larger delay per rank), ``lost`` and ``timeouts``."""
    n, samples = code.shape
    one_way = last.phase.src.astype(np.int64) * n + last.phase.dst
    if last.two_way is not None:
        one_way = one_way[~last.two_way]
    follows = np.isin(step.dst.astype(np.int64) * n + np.arange(n), one_way)
    bursts = _path_bursts(model, step.pattern.routes, step.hazard)
    if bursts is None or not follows.any():
        return
    flow, sample = np.nonzero(rng.random((n, samples)) < np.where(follows, bursts.entry_q, 0.0)[:, None])
    if flow.size == 0:
        return
    routes = step.pattern.routes
    hazard = np.asarray(np.bincount(routes.flow_of_entry(), weights=step.hazard, minlength=routes.num_flows), float)
    link = _draw_links(rng, routes, np.cumsum(step.hazard), hazard, flow)
    rate = step.pattern.rate_Bps[flow]
    extra, fired = draw_held_ack_seconds(
        rng,
        model.stack,
        rtt=2 * routes.latency_s[flow],
        tau=np.where(np.isfinite(rate), model.mtu / rate, 0.0),
        bursts=Bursts(bursts.entry_q[flow], bursts.stay[flow], bursts.hold_s),
        crossing=_frames_crossing(routes, flow, link),
    )
    receiver = step.dst[flow]
    larger = extra > delay[receiver, sample]
    delay[receiver[larger], sample[larger]] = extra[larger]
    code[receiver[larger], sample[larger]] = n + link[larger]
    np.add.at(lost, sample, extra > 0)
    np.add.at(timeouts, sample, fired)
