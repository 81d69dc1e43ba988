"""allreduce: the gradient All-Reduce of data-parallel training, and what the network does to it.

The runtime is re-exported here: ``group = allreduce.init(); group.all_reduce(x)``.
"""

from allreduce.runtime import (
    ChecksumError,
    CollectiveError,
    CollectiveTimeoutError,
    MismatchError,
    PeerFailureError,
    ProcessGroup,
    ProtocolError,
    ShrinkError,
    Work,
    WrongThreadError,
    init,
)

__version__ = "0.1.0"

__all__ = [
    "ChecksumError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "MismatchError",
    "PeerFailureError",
    "ProcessGroup",
    "ProtocolError",
    "ShrinkError",
    "Work",
    "WrongThreadError",
    "__version__",
    "init",
]
