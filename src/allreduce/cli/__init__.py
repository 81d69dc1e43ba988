"""The ``allreduce`` command."""

from allreduce.cli._main import CLIError, main

__all__ = ["CLIError", "main"]
