"""Run a user-defined algorithm between real ranks and check every element.

    .venv/bin/allreduce run -n 4 --algorithm examples/algorithms/my_ring.py:bidirectional_ring \\
        -- .venv/bin/python examples/user_algorithm.py

`allreduce run --algorithm SPEC` verifies the algorithm once, then every rank registers it under its name.
"""

import numpy as np

import allreduce

with allreduce.init() as group:
    n = 1_000_003  # a prime count: blocks of unequal size
    x = np.arange(n, dtype=np.int64) * (group.rank + 1)
    group.all_reduce(x, algorithm="bidirectional_ring")
    expected = np.arange(n, dtype=np.int64) * (group.world_size * (group.world_size + 1) // 2)
    print(f"bidirectional_ring over {group.transport_name}: {'exact' if np.array_equal(x, expected) else 'WRONG'}")
