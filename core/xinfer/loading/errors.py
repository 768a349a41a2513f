"""What is wrong with a model's files, said in one line that names the file."""

from __future__ import annotations


class ModelFileError(ValueError):
    pass


def first_line(error: BaseException | str) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def amount(num_bytes: int) -> str:
    """A size as people read it: ``50 MB``, ``3,072 bytes``."""
    return f"{num_bytes / 1e6:,.0f} MB" if num_bytes >= 10**6 else f"{num_bytes:,} bytes"
