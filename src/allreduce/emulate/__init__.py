"""Emulated clusters: a topology built as Linux network namespaces on this machine, the runtime run across it.

:func:`layout` turns a topology into namespaces, veth cables, addresses, shaped rates and routes (pure);
:func:`build` creates the layout an :class:`EmulationSpec` describes (root and iproute2 needed), recording
everything in a state file before it creates it, and :func:`remove` removes exactly that; :func:`running` does
both around a block. :func:`run` times all-reduce across the hosts with the real runtime over TCP and puts the
simulator's prediction for the same network beside every measurement, routing every flow on the path the
kernel chose for it (:func:`kernel_paths`).
"""

from allreduce.emulate._layout import MAX_HOSTS, MIN_BURST_BYTES, WIRE_BURST_BYTES, Cable, Layout, Route, layout
from allreduce.emulate._loss import (
    GSO_MAX_SEGS,
    LOSS_TABLE,
    LossSpec,
    bad_state_timeout_s,
    jiffy_s,
    loss_commands,
    lossy_end,
    read_counters,
)
from allreduce.emulate._netns import (
    DEFAULT_LOSS_RATE_BPS,
    DEFAULT_NAME,
    DEFAULT_QUEUE_BYTES,
    DEFAULT_RATE_BPS,
    STATE_DIR,
    EmulationError,
    EmulationSpec,
    build,
    check_privileges,
    existing_emulations,
    load,
    remove,
    running,
)
from allreduce.emulate._paths import Connection, kernel_paths
from allreduce.emulate._run import (
    BURST_NOTE_SHARE,
    DEFAULT_CONGESTION,
    GOODPUT,
    TAIL_MIN_REPS,
    TAIL_STACKS,
    Measurement,
    RunResult,
    measure_hop_latency,
    predicted_topology,
    run,
    tail_predictions,
    tail_samples,
)

__all__ = [
    "BURST_NOTE_SHARE",
    "DEFAULT_CONGESTION",
    "DEFAULT_LOSS_RATE_BPS",
    "DEFAULT_NAME",
    "DEFAULT_QUEUE_BYTES",
    "DEFAULT_RATE_BPS",
    "GOODPUT",
    "GSO_MAX_SEGS",
    "LOSS_TABLE",
    "MAX_HOSTS",
    "MIN_BURST_BYTES",
    "STATE_DIR",
    "TAIL_MIN_REPS",
    "TAIL_STACKS",
    "WIRE_BURST_BYTES",
    "Cable",
    "Connection",
    "EmulationError",
    "EmulationSpec",
    "Layout",
    "LossSpec",
    "Measurement",
    "Route",
    "RunResult",
    "bad_state_timeout_s",
    "build",
    "check_privileges",
    "existing_emulations",
    "jiffy_s",
    "kernel_paths",
    "layout",
    "load",
    "loss_commands",
    "lossy_end",
    "measure_hop_latency",
    "predicted_topology",
    "read_counters",
    "remove",
    "run",
    "running",
    "tail_predictions",
    "tail_samples",
]
