"""The step-time planner: a model's gradient in DDP buckets, overlapped with backward, on a simulated cluster.

:func:`plan` answers "what does a training step cost here, how does it scale, and what would one change do";
:func:`plan_step` is one configuration (what a sweep case computes); :func:`run_sweep` runs many on any executor.
"""

from allreduce.plan._planner import (
    AUTO,
    Plan,
    PlanRequest,
    ScalingRow,
    SizeRun,
    StepPlan,
    WhatIf,
    compute_seconds,
    plan,
    plan_step,
    scaling_counts,
)
from allreduce.plan._step import BACKWARD_FRACTION, Compute, StepTime, step_time
from allreduce.plan._sweep import (
    COLUMNS,
    PARAMETERS,
    DaskExecutor,
    SweepSummary,
    case_id,
    expand_grid,
    load_grid,
    make_executor,
    request_of,
    run_case,
    run_sweep,
)
from allreduce.plan._workload import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    GRADIENT_DTYPES,
    PRESETS,
    Model,
    ddp_buckets,
    model_from_module,
    model_from_params,
    preset,
)

__all__ = [
    "AUTO",
    "BACKWARD_FRACTION",
    "COLUMNS",
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "GRADIENT_DTYPES",
    "PARAMETERS",
    "PRESETS",
    "Compute",
    "DaskExecutor",
    "Model",
    "Plan",
    "PlanRequest",
    "ScalingRow",
    "SizeRun",
    "StepPlan",
    "StepTime",
    "SweepSummary",
    "WhatIf",
    "case_id",
    "compute_seconds",
    "ddp_buckets",
    "expand_grid",
    "load_grid",
    "make_executor",
    "model_from_module",
    "model_from_params",
    "plan",
    "plan_step",
    "preset",
    "request_of",
    "run_case",
    "run_sweep",
    "scaling_counts",
    "step_time",
]
