"""Argument types the benchmarks share (each benchmark module defines its own flags)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1, else argparse's usage error naming the flag."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
