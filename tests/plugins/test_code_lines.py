"""benchmarks/code_lines.py counts what issue #29 and the README's plugin table count: non-blank
lines that are neither comments nor docstrings."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from code_lines import code_lines

SOURCE = '''"""A module docstring
over two lines."""

import os  # a comment after code counts as code

# a comment line


class A:
    """A class docstring."""

    x = """not a docstring:
a string assigned"""

    def f(self):
        """One line."""
        return (1,
                2)
'''


def test_blank_comment_and_docstring_lines_are_not_code():
    # import, class, x = (2 lines), def, return (2 lines)
    assert code_lines(SOURCE) == 7


def test_the_core_counts_more_than_zero_and_every_file_parses():
    core = Path(__file__).resolve().parents[2] / "core" / "xinfer"
    assert sum(code_lines(path.read_text()) for path in core.rglob("*.py")) > 1000
