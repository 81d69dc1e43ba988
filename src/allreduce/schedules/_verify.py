"""Symbolic verification: replay every rank's program on placeholder data.

Each block of each rank holds the *set of ranks whose contributions it contains* (a bit mask), or nothing
(the block has not arrived). Sends are matched to receives in channel order, ranks advance step by step as their
operations' partners arrive, and at the end the collective's postcondition is checked. Every failure names the
rank, the step and the block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from allreduce.schedules._schedule import Collective, Op, Schedule, Verb

__all__ = ["ScheduleError", "verify", "verify_programs"]


class ScheduleError(ValueError):
    """A schedule breaks its collective's contract; the message names the rank, step and block."""


_Match = tuple[int, int]
"""(rank, index in the rank's program) of an op's partner."""


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
    send = Verb.SEND

    # ---- static checks: well-formed ops, steps in order; each program's channels and steps noted ----------
    # A channel (src, dst) is keyed src·N + dst, which sorts as the pair does. steps[rank][g] = (step, indices of
    # its ops); group_of[rank][i] = g of op i; waiting[rank][g] = how many of step g's partner ops have not been
    # posted yet (the step can complete at 0); multi_recv[rank][g] = whether step g receives more than once.
    sends: dict[int, list[int]] = {}
    recvs: dict[int, list[int]] = {}
    steps: list[list[tuple[int, list[int]]]] = []
    group_of: list[list[int]] = []
    waiting: list[list[int]] = []
    multi_recv: list[list[bool]] = []
    for rank, program in enumerate(programs):
        last_step = -1
        grouped: list[tuple[int, list[int]]] = []
        of: list[int] = []
        sizes: list[int] = []
        receives: list[int] = []
        for i, op in enumerate(program):
            step, verb, peer, start, stop = op
            if not (0 <= peer < n and peer != rank and 0 <= start < stop <= num_blocks):
                _raise_malformed(name, rank, op, n, num_blocks)
            if step < last_step:
                raise ScheduleError(
                    f"{name}: rank {rank} {op}: comes after step {last_step}; steps must not go backwards"
                )
            if verb is send:
                sends.setdefault(rank * n + peer, []).append(i)
            else:
                recvs.setdefault(peer * n + rank, []).append(i)
            if grouped and step == last_step:
                grouped[-1][1].append(i)
                sizes[-1] += 1
                receives[-1] += verb is not send
            else:
                grouped.append((step, [i]))
                sizes.append(1)
                receives.append(verb is not send)
            of.append(len(grouped) - 1)
            last_step = step
        steps.append(grouped)
        group_of.append(of)
        waiting.append(sizes)
        multi_recv.append([count > 1 for count in receives])

    # ---- matching: k-th send a->b pairs with the k-th receive at b from a --------------------------------
    partner: list[list[_Match | None]] = [[None] * len(p) for p in programs]
    for channel in sorted(sends.keys() | recvs.keys()):
        src, dst = divmod(channel, n)
        s_list, r_list = sends.get(channel, []), recvs.get(channel, [])
        src_program, dst_program, src_partner, dst_partner = programs[src], programs[dst], partner[src], partner[dst]
        for s_index, r_index in zip(s_list, r_list, strict=False):  # the longer one is named below
            send_op, recv_op = src_program[s_index], dst_program[r_index]
            if send_op[3] != recv_op[3] or send_op[4] != recv_op[4]:
                raise ScheduleError(f"{name}: rank {dst} {recv_op}, but the matching send of rank {src} is {send_op}")
            src_partner[s_index] = (dst, r_index)
            dst_partner[r_index] = (src, s_index)
        k = min(len(s_list), len(r_list))
        if k < len(s_list):
            op = src_program[s_list[k]]
            raise ScheduleError(
                f"{name}: rank {src} {op}, but rank {dst} posts no matching receive "
                f"(it receives {len(r_list)} time(s) from rank {src}, this is send #{k + 1})"
            )
        if k < len(r_list):
            op = dst_program[r_list[k]]
            raise ScheduleError(
                f"{name}: rank {dst} {op}, but rank {src} never sends it "
                f"(it sends {len(s_list)} time(s) to rank {dst}, this is receive #{k + 1})"
            )

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
    posted_snapshot: list[list[list[int | None]]] = [[[] for _ in p] for p in programs]  # op index -> data sent

    def post(rank: int) -> None:
        """Rank ``rank`` begins its current step: its sends read the blocks as they are now."""
        g = position[rank]
        step, indices = steps[rank][g]
        program, held, posted_here, snapshot, partner_of = (
            programs[rank], state[rank], posted[rank], posted_snapshot[rank], partner[rank]
        )  # fmt: skip
        for i in indices:
            posted_here[i] = True
            m_rank, m_index = partner_of[i]  # type: ignore[misc]
            waiting[m_rank][group_of[m_rank][m_index]] -= 1
            op = program[i]
            if op[1] is send:
                data = held[op[3] : op[4]]
                if None in data:
                    b = op[3] + data.index(None)
                    raise ScheduleError(
                        f"{name}: rank {rank} step {step} sends block {b} to rank {op[2]} before it has "
                        f"arrived (rank {rank} holds no data for block {b} yet)"
                    )
                snapshot[i] = data
        if not multi_recv[rank][g]:
            return  # one receive cannot overwrite another
        written: dict[int, Op] = {}
        for i in indices:
            op = program[i]
            if op[1] is not send:
                for b in range(op[3], op[4]):
                    other = written.get(b)
                    if other is not None and (op[1] is Verb.RECV_COPY or other[1] is Verb.RECV_COPY):
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
        g = position[rank]
        if g >= len(steps[rank]) or waiting[rank][g]:
            continue
        # Apply this step's receives, in program order; queue this rank again, then the partners of its ops.
        ready.append(rank)
        queued[rank] = True
        step, indices = steps[rank][g]
        program, held, partner_of = programs[rank], state[rank], partner[rank]
        for i in indices:
            m_rank, m_index = partner_of[i]  # type: ignore[misc]
            if not queued[m_rank]:
                queued[m_rank] = True
                ready.append(m_rank)
            _, verb, peer, start, stop = program[i]
            if verb is send:
                continue
            incoming = posted_snapshot[m_rank][m_index]
            if verb is Verb.RECV_COPY:
                held[start:stop] = incoming
                continue
            for b, value in zip(range(start, stop), incoming, strict=True):
                current = held[b]
                if current is None:
                    raise ScheduleError(
                        f"{name}: rank {rank} step {step} reduces block {b} from rank {peer} into a block it "
                        f"holds no data for"
                    )
                assert value is not None
                twice = current & value
                if twice:
                    raise ScheduleError(
                        f"{name}: rank {rank} step {step} reduces block {b} from rank {peer} and counts "
                        f"the contribution of rank(s) {_ranks(twice)} twice"
                    )
                held[b] = current | value
        position[rank] = g + 1
        if g + 1 < len(steps[rank]):
            post(rank)

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
            if not posted[m[0]][m[1]]:
                waits[rank] = (m[0], programs[rank][i])
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
