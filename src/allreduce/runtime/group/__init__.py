"""The process group and how a rank joins one: ``init()`` (environment, store, a transport from the registry), the
collectives of :class:`ProcessGroup`, in-process groups for tests, and the cost models ``auto`` picks by."""
