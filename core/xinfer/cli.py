"""The ``xinfer`` command.

``xinfer [flags]`` serves (``xinfer serve [flags]`` too), ``xinfer --i [flags]`` or
``xinfer chat [flags]`` chats in the terminal, ``xinfer --prompts "a|b"`` answers
prompts and exits, ``xinfer plugins`` lists plugins.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command == "plugins":
        return list_plugins(as_json="--json" in argv[1:])
    if command in ("serve", "chat"):
        argv = argv[1:]
    from xinfer.server.args import parse_args

    args = parse_args(argv, prog="xinfer")
    if command == "chat" or args.interactive or args.prompts:
        from xinfer.chat import run

        return run(args)
    from xinfer.server.launch import run

    return run(args)


def list_plugins(as_json: bool = False) -> int:
    from xinfer import registry

    infos = registry.plugins()
    if as_json:
        print(json.dumps([asdict(info) for info in infos], indent=2))
        return 0
    if not infos:
        print("no plugins installed (pip install xinfer-cpu xinfer-llama)")
    for info in infos:
        print(f"{info.name} {info.version}")
        print(f"  hooks: {', '.join(info.hooks) or '-'}")
        if info.architectures:
            print(f"  architectures: {', '.join(info.architectures)}")
        if info.backends:
            print(f"  backends: {', '.join(info.backends)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
