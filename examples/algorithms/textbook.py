"""The ring all-reduce and the binomial broadcast, written with the authoring API as the textbook draws them.

These are the worked examples of docs/algorithms.md; the tests check that they compile to exactly the built-in
schedules.
"""

from __future__ import annotations

from allreduce.schedules import Program


def authored_ring(world_size: int) -> Program:
    """Ring all-reduce: N-1 steps of reduce-scatter, then N-1 steps of all-gather, one block per step."""
    n = world_size
    p = Program(n, num_blocks=n)
    for j in range(n - 1):  # reduce-scatter: step j of N-1
        step = p.step()
        for r in range(n):
            right, block = (r + 1) % n, (r - j - 1) % n
            step.send(r, right, block)
            step.recv_reduce(right, r, block)
    for j in range(n - 1):  # all-gather: step j of N-1
        step = p.step()
        for r in range(n):
            right, block = (r + 1) % n, (r - j) % n
            step.send(r, right, block)
            step.recv_copy(right, r, block)
    return p


def authored_binomial(world_size: int, root: int = 0) -> Program:
    """Binomial-tree broadcast: the ranks holding the data double every step, ceil(log2 N) steps."""
    n = world_size
    p = Program(n, num_blocks=1, collective="broadcast", root=root)
    distance = 1
    while distance < n:  # step log2(distance): ranks 0..distance-1 (relative to root) send distance further
        step = p.step()
        for rel in range(min(distance, n - distance)):
            src, dst = (root + rel) % n, (root + rel + distance) % n
            step.send(src, dst, 0)
            step.recv_copy(dst, src, 0)
        distance *= 2
    return p
