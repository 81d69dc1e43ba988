"""Point-to-point messages: ``send``/``recv`` between two ranks of a group, on channels of their own.

Collectives pair by call order and agree on a descriptor before data moves; a point-to-point call involves two
ranks only, so it travels apart from them, on one TCP connection per ordered pair of ranks (made on the first
send), whatever transport the group's collectives run on. Messages are matched as MPI and Gloo match them: per
source and tag, in order.

- :mod:`._inbox`: the receives and the messages that arrive, matched; the deadlines;
- :mod:`._channels`: the listener, the connections to the peers a rank sends to, the calls.
"""

from allreduce.runtime.p2p._channels import MAX_TAG, PointToPoint
from allreduce.runtime.p2p._inbox import DTYPE_NAMES

__all__ = ["DTYPE_NAMES", "MAX_TAG", "PointToPoint"]
