"""Shared test configuration."""

from hypothesis import HealthCheck, settings

# CI runs on 2 shared cores: no per-example deadline, a fixed number of examples, deterministic seeds.
settings.register_profile(
    "ci", deadline=None, max_examples=60, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")
