"""A small plan, computed once, for the report's tests."""

from __future__ import annotations

from typing import Any

import pytest

from allreduce.plan import Compute, PlanRequest, model_from_params, plan


@pytest.fixture(scope="session")
def plan_document() -> dict[str, Any]:
    request = PlanRequest(
        model=model_from_params(5e7), gpus=16, topology="fat-tree:k=4", compute=Compute(0.02), algorithm="auto"
    )
    return plan(request).to_json()
