"""Recording what a group's collectives did: per-step wait records, the group-wide summary, Perfetto traces."""
