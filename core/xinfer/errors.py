"""Errors of bad arguments that more than one part raises."""

from __future__ import annotations


class WrongTypeError(ValueError, TypeError):
    """An argument of the wrong type: a ValueError, as every bad argument to xinfer is, and a TypeError."""
