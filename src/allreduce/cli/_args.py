"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["non_negative_int", "positive_int"]


def _int_at_least(name: str, minimum: int) -> Callable[[str], int]:
    """An argparse type for a whole number >= ``minimum``; errors name the option (``name``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value

    return parse


def positive_int(name: str) -> Callable[[str], int]:
    """A whole number >= 1."""
    return _int_at_least(name, 1)


def non_negative_int(name: str) -> Callable[[str], int]:
    """A whole number >= 0."""
    return _int_at_least(name, 0)
