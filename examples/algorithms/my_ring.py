"""A bidirectional ring all-reduce, written with the authoring API: a user algorithm to load by spec.

Half of every block travels clockwise, the other half counter-clockwise, so both directions of every link carry
data at once. Same 2(N-1) steps as the ring; each rank sends half as much in each direction.

    allreduce explain --ranks 64 --size 1GiB --bandwidth 400Gbps --latency 5us \\
        --algorithm ring,examples/algorithms/my_ring.py:bidirectional_ring
    PYTHONPATH=examples/algorithms allreduce sim --topology fat-tree:k=4 --size 64MiB -a my_ring:bidirectional_ring
"""

from __future__ import annotations

from allreduce.schedules import Program


def bidirectional_ring(world_size: int) -> Program:
    """Two rings in opposite directions, each all-reducing half of the buffer."""
    n = world_size
    # Blocks 0..N-1 are the clockwise half, N..2N-1 the counter-clockwise half.
    p = Program(world_size, num_blocks=2 * n)
    for j in range(n - 1):  # reduce-scatter: step j of N-1
        step = p.step()
        for r in range(n):
            right, left = (r + 1) % n, (r - 1) % n
            step.send(r, right, (r - j - 1) % n)
            step.recv_reduce(right, r, (r - j - 1) % n)
            step.send(r, left, n + (r + j + 1) % n)
            step.recv_reduce(left, r, n + (r + j + 1) % n)
    for j in range(n - 1):  # all-gather: step j of N-1
        step = p.step()
        for r in range(n):
            right, left = (r + 1) % n, (r - 1) % n
            step.send(r, right, (r - j) % n)
            step.recv_copy(right, r, (r - j) % n)
            step.send(r, left, n + (r + j) % n)
            step.recv_copy(left, r, n + (r + j) % n)
    return p
