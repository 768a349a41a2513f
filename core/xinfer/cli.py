"""The ``xinfer`` command.

``xinfer [flags]`` serves (``xinfer serve [flags]`` too), ``xinfer --i [flags]`` or
``xinfer chat [flags]`` chats in the terminal, ``xinfer --prompts "a|b"`` answers
prompts and exits, ``xinfer plugins [--json]`` lists plugins.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # the reader went away (xinfer plugins --json | head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush stays quiet
        return 0


def _run(argv: list[str]) -> int:
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command == "plugins":
        return list_plugins(as_json="--json" in argv[1:])
    if command in ("serve", "chat"):
        argv = argv[1:]
    from xinfer.server.args import parse_args
    from xinfer.server.launch import setup_logging

    args = parse_args(argv, prog="xinfer")
    setup_logging(args)
    if command == "chat" or args.interactive or args.prompts:
        from xinfer.chat import run

        return run(args)
    from xinfer.server.launch import run

    return run(args)


def list_plugins(as_json: bool = False) -> int:
    from xinfer import registry

    infos = registry.plugins()
    print(json.dumps([asdict(info) for info in infos], indent=2) if as_json else describe(infos))
    sys.stdout.flush()
    return 0


def describe(infos: list) -> str:
    if not infos:
        return "no plugins installed (from xinfer's repository: pip install ./backends/cpu ./plugins/llama)"
    lines = []
    for info in infos:
        if info.error:
            lines += [f"{info.name} {info.version}  BROKEN, skipped", f"  error: {info.error}"]
            continue
        lines += [f"{info.name} {info.version}", f"  hooks: {', '.join(info.hooks) or '-'}"]
        if info.architectures:
            lines.append(f"  architectures: {', '.join(info.architectures)}")
        if info.gguf_architectures:
            lines.append(f"  GGUF architectures: {', '.join(info.gguf_architectures)}")
        if info.backends:
            lines.append(f"  backends: {', '.join(f'{name} ({state})' for name, state in info.backends.items())}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
