"""allreduce: the gradient All-Reduce of data-parallel training, and what the network does to it."""

__version__ = "0.1.0"

__all__ = ["__version__"]
