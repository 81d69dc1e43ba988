"""The shared-memory transport: ranks on one host reduce straight out of each other's memory.

- :mod:`~allreduce.runtime.shm._linux`: futex, ``process_vm_readv``, pidfd, PID namespace;
- :mod:`~allreduce.runtime.shm._segments`: /dev/shm files (naming, mapping, sweeping, the peer cache);
- :mod:`~allreduce.runtime.shm._layout`: the control block every rank publishes, one declared layout;
- :mod:`~allreduce.runtime.shm._compile`: a rank's plan compiled into shared-memory operations (pure);
- :mod:`~allreduce.runtime.shm._rendezvous`: start-up (map the peers' control blocks, pidfds, the cross-memory probe);
- :mod:`~allreduce.runtime.shm._ptracer`: Yama's ptracer discipline (one reader of private memory at a time);
- :mod:`~allreduce.runtime.shm._watch`: watching for dead, closed, aborted or stalled peers;
- :mod:`~allreduce.runtime.shm._waiting`: publishing this rank's counters and waiting on peers';
- :mod:`~allreduce.runtime.shm._agreement`: the descriptor exchange of one collective;
- :mod:`~allreduce.runtime.shm._adopt`: moving a large buffer used again onto shared pages at its own address;
- :mod:`~allreduce.runtime.shm._peer_data`: where a peer's data is for one collective, and reading it;
- :mod:`~allreduce.runtime.shm._huge_pages`: which of this rank's buffers are on huge pages (read in place);
- :mod:`~allreduce.runtime.shm._small`: the head start of a small buffer, and a small all-reduce in one pass;
- :mod:`~allreduce.runtime.shm._transport`: :class:`ShmTransport`, composed of the parts above, which runs the
  compiled steps.
"""

from allreduce.runtime.shm._adopt import ADOPT_ENV, ADOPT_MIN_BYTES
from allreduce.runtime.shm._layout import CRC_SLOTS_PER_PEER, DESCRIPTOR_BYTES, EAGER_BYTES, MAX_RANKS
from allreduce.runtime.shm._peer_data import CROSS_MEMORY_CHUNK_BYTES
from allreduce.runtime.shm._rendezvous import CROSS_MEMORY_ENV, CROSS_MEMORY_MODES
from allreduce.runtime.shm._segments import PEER_SEGMENT_CACHE_ENTRIES, SHM_DIR, shm_prefix, sweep_stale_segments
from allreduce.runtime.shm._small import eager_step_bound
from allreduce.runtime.shm._transport import CROSS_MEMORY_MIN_BYTES, ShmTransport
from allreduce.runtime.shm._waiting import MIN_SPIN_S, POLL_S, SPIN_S, YIELD_S

__all__ = [
    "ADOPT_ENV",
    "ADOPT_MIN_BYTES",
    "CRC_SLOTS_PER_PEER",
    "CROSS_MEMORY_CHUNK_BYTES",
    "CROSS_MEMORY_ENV",
    "CROSS_MEMORY_MIN_BYTES",
    "CROSS_MEMORY_MODES",
    "DESCRIPTOR_BYTES",
    "EAGER_BYTES",
    "MAX_RANKS",
    "MIN_SPIN_S",
    "PEER_SEGMENT_CACHE_ENTRIES",
    "POLL_S",
    "SHM_DIR",
    "SPIN_S",
    "YIELD_S",
    "ShmTransport",
    "eager_step_bound",
    "shm_prefix",
    "sweep_stale_segments",
]
