"""Code lines of Python files: non-blank lines that are neither comments nor docstrings (the
measure issue #29 sets for the core and the README's plugin table uses, imports included here).

    python benchmarks/code_lines.py core/xinfer            # the total, and the 20 largest files
    python benchmarks/code_lines.py plugins/glm/xinfer_glm/glm4.py
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    docstrings = docstring_lines(ast.parse(source))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args()
    files = [p for root in args.paths for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    counts = {path: code_lines(path.read_text()) for path in files}
    for path, count in sorted(counts.items(), key=lambda item: -item[1])[:20]:
        print(f"{count:6d}  {path}")
    print(f"{sum(counts.values()):6d}  total, {len(counts)} files")


if __name__ == "__main__":
    main()
