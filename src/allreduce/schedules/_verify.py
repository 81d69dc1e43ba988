"""Symbolic verification: replay every rank's program on placeholder data.

Each block of each rank holds the *set of ranks whose contributions it contains* (a bit mask), or nothing
(the block has not arrived). Sends are matched to receives in channel order, ranks advance step by step as their
operations' partners arrive, and at the end the collective's postcondition is checked. Every failure names the
rank, the step and the block.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from allreduce.schedules._schedule import Collective, Op, Schedule, Verb

__all__ = ["ScheduleError", "verify", "verify_programs"]


class ScheduleError(ValueError):
    """A schedule breaks its collective's contract; the message names the rank, step and block."""


@dataclass(frozen=True)
class _Match:
    rank: int
    index: int  # position in the rank's program


def _owner(block: int, world_size: int, num_blocks: int) -> int:
    """Rank that owns ``block`` in reduce-scatter output / all-gather, gather and scatter (rank r owns the r-th
    N-th)."""
    return block * world_size // num_blocks


def _pair(block: int, world_size: int, num_blocks: int) -> tuple[int, int]:
    """(source, destination) of an all-to-all block: block s·N + d of N² carries rank s's part for rank d."""
    return divmod(block * world_size * world_size // num_blocks, world_size)


def _initial_blocks(collective: Collective, rank: int, n: int, num_blocks: int, root: int) -> list[int | None]:
    """What ``rank``'s blocks hold before the first step: the set of ranks whose data each block carries (None:
    nothing yet). Scatter labels the root's block b with rank b, its destination, so that delivery is checked."""
    blocks = range(num_blocks)
    if collective in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE):
        return [1 << rank] * num_blocks
    if collective in (Collective.ALL_GATHER, Collective.GATHER):
        return [1 << rank if _owner(b, n, num_blocks) == rank else None for b in blocks]
    if collective is Collective.ALL_TO_ALL:
        return [1 << rank if _pair(b, n, num_blocks)[0] == rank else None for b in blocks]
    if collective is Collective.SCATTER:
        return [1 << _owner(b, n, num_blocks) if rank == root else None for b in blocks]
    return [1 << root if rank == root else None] * num_blocks  # broadcast


def _raise_malformed(name: str, rank: int, op: Op, n: int, num_blocks: int) -> None:
    """The static check's error for an op whose peer or blocks are impossible (built only when one is)."""
    where = f"{name}: rank {rank} {op}"
    if not 0 <= op.peer < n:
        raise ScheduleError(f"{where}: peer {op.peer} is not a rank (world size {n})")
    if op.peer == rank:
        raise ScheduleError(f"{where}: a rank cannot exchange with itself")
    raise ScheduleError(f"{where}: blocks out of range (the buffer has {num_blocks} blocks)")


def verify(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` computes its collective. Returns None when it does."""
    verify_programs(
        schedule.programs(),
        collective=schedule.collective,
        num_blocks=schedule.num_blocks,
        root=schedule.root,
        name=schedule.name,
    )


def verify_programs(
    programs: Sequence[Sequence[Op]],
    *,
    collective: Collective,
    num_blocks: int,
    root: int = 0,
    name: str = "schedule",
) -> None:
    """Verify per-rank programs (one list of :class:`Op` per rank) against ``collective``'s postcondition."""
    n = len(programs)
    full = (1 << n) - 1

    # ---- static checks: well-formed ops, steps in order --------------------------------------------------
    for rank, program in enumerate(programs):
        last_step = -1
        for op in program:
            if not (0 <= op.peer < n and op.peer != rank and 0 <= op.block_start < op.block_stop <= num_blocks):
                _raise_malformed(name, rank, op, n, num_blocks)
            if op.step < last_step:
                raise ScheduleError(
                    f"{name}: rank {rank} {op}: comes after step {last_step}; steps must not go backwards"
                )
            last_step = op.step

    # ---- matching: k-th send a->b pairs with the k-th receive at b from a --------------------------------
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, program in enumerate(programs):
        for i, op in enumerate(program):
            if op.verb is Verb.SEND:
                sends[(rank, op.peer)].append(i)
            else:
                recvs[(op.peer, rank)].append(i)
    partner: list[list[_Match | None]] = [[None] * len(p) for p in programs]
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        s_list, r_list = sends.get(channel, []), recvs.get(channel, [])
        for k in range(max(len(s_list), len(r_list))):
            if k >= len(r_list):
                op = programs[src][s_list[k]]
                raise ScheduleError(
                    f"{name}: rank {src} {op}, but rank {dst} posts no matching receive "
                    f"(it receives {len(r_list)} time(s) from rank {src}, this is send #{k + 1})"
                )
            if k >= len(s_list):
                op = programs[dst][r_list[k]]
                raise ScheduleError(
                    f"{name}: rank {dst} {op}, but rank {src} never sends it "
                    f"(it sends {len(s_list)} time(s) to rank {dst}, this is receive #{k + 1})"
                )
            send_op, recv_op = programs[src][s_list[k]], programs[dst][r_list[k]]
            if (send_op.block_start, send_op.block_stop) != (recv_op.block_start, recv_op.block_stop):
                raise ScheduleError(f"{name}: rank {dst} {recv_op}, but the matching send of rank {src} is {send_op}")
            partner[src][s_list[k]] = _Match(dst, r_list[k])
            partner[dst][r_list[k]] = _Match(src, s_list[k])

    # ---- group each program into steps --------------------------------------------------------------------
    steps: list[list[tuple[int, list[int]]]] = []
    for program in programs:
        grouped: list[tuple[int, list[int]]] = []
        for i, op in enumerate(program):
            if grouped and grouped[-1][0] == op.step:
                grouped[-1][1].append(i)
            else:
                grouped.append((op.step, [i]))
        steps.append(grouped)

    # ---- initial state ------------------------------------------------------------------------------------
    if collective is Collective.ALL_TO_ALL and num_blocks % (n * n):
        raise ScheduleError(
            f"{name}: an all_to_all schedule cuts the buffer into a multiple of N² = {n * n} blocks "
            f"(block s·N + d: rank s's part for rank d); it has {num_blocks}"
        )
    state = [_initial_blocks(collective, rank, n, num_blocks, root) for rank in range(n)]

    # ---- replay: a rank's step completes when every partner of its ops has posted them --------------------
    position = [0] * n  # index into steps[rank] of the step in progress
    posted = [[False] * len(p) for p in programs]  # has the op's rank reached the op's step yet?
    posted_snapshot: list[dict[int, list[int | None]]] = [{} for _ in range(n)]  # op index -> data sent

    def post(rank: int) -> None:
        """Rank ``rank`` begins its current step: its sends read the blocks as they are now."""
        step, indices = steps[rank][position[rank]]
        for i in indices:
            posted[rank][i] = True
            op = programs[rank][i]
            if op.verb is Verb.SEND:
                data = state[rank][op.block_start : op.block_stop]
                for b, value in zip(range(op.block_start, op.block_stop), data, strict=True):
                    if value is None:
                        raise ScheduleError(
                            f"{name}: rank {rank} step {step} sends block {b} to rank {op.peer} before it has "
                            f"arrived (rank {rank} holds no data for block {b} yet)"
                        )
                posted_snapshot[rank][i] = data
        written: dict[int, Op] = {}
        for i in indices:
            op = programs[rank][i]
            if op.verb is Verb.RECV_COPY or op.verb is Verb.RECV_REDUCE:
                for b in range(op.block_start, op.block_stop):
                    other = written.get(b)
                    if other is not None and (op.verb is Verb.RECV_COPY or other.verb is Verb.RECV_COPY):
                        raise ScheduleError(
                            f"{name}: rank {rank} step {step} receives block {b} twice in one step "
                            f"({other} and {op}), and one of them overwrites: the result depends on timing"
                        )
                    written[b] = op

    for rank in range(n):
        if steps[rank]:
            post(rank)
    # A rank is queued at most once: its check when it leaves the queue sees every change made before then.
    ready = deque(range(n))
    queued = [True] * n
    while ready:
        rank = ready.popleft()
        queued[rank] = False
        if position[rank] >= len(steps[rank]):
            continue
        step, indices = steps[rank][position[rank]]
        matches = [partner[rank][i] for i in indices]  # every op has one: matching raised otherwise
        if not all(posted[m.rank][m.index] for m in matches):  # type: ignore[union-attr]
            continue
        # Apply this step's receives, in program order.
        program, held = programs[rank], state[rank]
        for i, m in zip(indices, matches, strict=True):
            op = program[i]
            if op.verb is Verb.SEND:
                continue
            assert m is not None
            incoming = posted_snapshot[m.rank][m.index]
            if op.verb is Verb.RECV_COPY:
                held[op.block_start : op.block_stop] = incoming
                continue
            for b, value in zip(range(op.block_start, op.block_stop), incoming, strict=True):
                current = held[b]
                if current is None:
                    raise ScheduleError(
                        f"{name}: rank {rank} step {step} reduces block {b} from rank {op.peer} into a block it "
                        f"holds no data for"
                    )
                assert value is not None
                twice = current & value
                if twice:
                    raise ScheduleError(
                        f"{name}: rank {rank} step {step} reduces block {b} from rank {op.peer} and counts "
                        f"the contribution of rank(s) {_ranks(twice)} twice"
                    )
                held[b] = current | value
        position[rank] += 1
        if position[rank] < len(steps[rank]):
            post(rank)
        for other in (rank, *(m.rank for m in matches)):  # type: ignore[union-attr]
            if not queued[other]:
                queued[other] = True
                ready.append(other)

    stuck = [r for r in range(n) if position[r] < len(steps[r])]
    if stuck:
        why = _describe_deadlock(
            programs=programs, steps=steps, position=position, partner=partner, posted=posted, stuck=stuck
        )
        raise ScheduleError(f"{name}: deadlock: {why}")

    # ---- postcondition ------------------------------------------------------------------------------------
    for rank in range(n):
        for b in range(num_blocks):
            value = state[rank][b]
            if (
                collective is Collective.ALL_REDUCE
                or (collective is Collective.REDUCE_SCATTER and _owner(b, n, num_blocks) == rank)
                or (collective is Collective.REDUCE and rank == root)
            ):
                want = full
            elif collective is Collective.ALL_GATHER:
                want = 1 << _owner(b, n, num_blocks)
            elif collective is Collective.BROADCAST:
                want = 1 << root
            elif collective is Collective.ALL_TO_ALL and _pair(b, n, num_blocks)[1] == rank:
                want = 1 << _pair(b, n, num_blocks)[0]
            elif (collective is Collective.GATHER and rank == root) or (
                collective is Collective.SCATTER and _owner(b, n, num_blocks) == rank
            ):
                want = 1 << _owner(b, n, num_blocks)
            else:
                continue
            if value != want:
                have = "no data" if value is None else f"contributions of ranks {_ranks(value)}"
                missing = "" if value is None else _missing(want, value)
                raise ScheduleError(
                    f"{name}: after {collective.value}, rank {rank} block {b} holds {have}; "
                    f"expected ranks {_ranks(want)}{missing}"
                )


def _ranks(mask: int) -> str:
    ranks = [i for i in range(mask.bit_length()) if mask >> i & 1]
    if len(ranks) > 8:
        return "{" + ", ".join(map(str, ranks[:4])) + f", … ({len(ranks)} ranks)" + "}"
    return "{" + ", ".join(map(str, ranks)) + "}"


def _missing(want: int, have: int) -> str:
    lost = want & ~have
    extra = have & ~want
    parts = []
    if lost:
        parts.append(f"missing {_ranks(lost)}")
    if extra:
        parts.append(f"unexpected {_ranks(extra)}")
    return " (" + "; ".join(parts) + ")" if parts else ""


def _describe_deadlock(
    *,
    programs: Sequence[Sequence[Op]],
    steps: list[list[tuple[int, list[int]]]],
    position: list[int],
    partner: list[list[_Match | None]],
    posted: list[list[bool]],
    stuck: list[int],
) -> str:
    """Name a cycle of waits if there is one, else the first stuck rank and what it waits for."""
    waits: dict[int, tuple[int, Op]] = {}
    for rank in stuck:
        _, indices = steps[rank][position[rank]]
        for i in indices:
            m = partner[rank][i]
            assert m is not None
            if not posted[m.rank][m.index]:
                waits[rank] = (m.rank, programs[rank][i])
                break
    # Follow the wait-for edges from the first stuck rank until a rank repeats.
    seen: list[int] = []
    rank = stuck[0]
    while rank in waits and rank not in seen:
        seen.append(rank)
        rank = waits[rank][0]
    if rank in seen:
        cycle = seen[seen.index(rank) :]
        links = [f"rank {r} ({waits[r][1]}) waits for rank {waits[r][0]}" for r in cycle]
        return "cycle of waits: " + "; ".join(links)
    first = stuck[0]
    peer, op = waits.get(first, (-1, programs[first][steps[first][position[first]][1][0]]))
    return f"rank {first} is stuck at {op}, waiting for rank {peer}"
