"""The transport interface every transport implements, the per-rank plan it executes, and the faults injected
into it."""
