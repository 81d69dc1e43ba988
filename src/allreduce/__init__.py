"""allreduce: the gradient All-Reduce of data-parallel training, and what the network does to it.

The runtime is re-exported here: ``group = allreduce.init(); group.all_reduce(x)``. Each name below is imported
``as`` itself, which is how a package re-exports a name (PEP 484) without writing the list twice.
"""

from allreduce.runtime import ChecksumError as ChecksumError
from allreduce.runtime import CollectiveError as CollectiveError
from allreduce.runtime import CollectiveTimeoutError as CollectiveTimeoutError
from allreduce.runtime import MismatchError as MismatchError
from allreduce.runtime import PeerFailureError as PeerFailureError
from allreduce.runtime import ProcessGroup as ProcessGroup
from allreduce.runtime import ProtocolError as ProtocolError
from allreduce.runtime import ShrinkError as ShrinkError
from allreduce.runtime import Work as Work
from allreduce.runtime import WrongThreadError as WrongThreadError
from allreduce.runtime import init as init

__version__ = "0.1.0"
