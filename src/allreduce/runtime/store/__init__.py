"""The rendezvous store: a TCP key-value store hosted by rank 0 (client, server, wire protocol), and an in-memory
store for in-process groups. The interface every store implements is :class:`allreduce.runtime.Store`."""
