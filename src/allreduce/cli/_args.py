"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["non_negative_int", "positive_int"]


def positive_int(name: str) -> Callable[[str], int]:
    """An argparse type for a whole number >= 1; errors name the option (``name``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def non_negative_int(name: str) -> Callable[[str], int]:
    """An argparse type for a whole number >= 0; errors name the option (``name``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {value}")
        return value

    return parse
