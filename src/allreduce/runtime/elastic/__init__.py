"""A group that changes while it runs: shrinking after ranks died, growing when one comes back, and re-planning
the ring around a slow link."""
