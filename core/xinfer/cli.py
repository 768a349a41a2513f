"""The ``xinfer`` command.

``xinfer [flags]`` serves (``xinfer serve [flags]`` too), ``xinfer --i [flags]`` or
``xinfer chat [flags]`` chats in the terminal, ``xinfer --prompts "a|b"`` answers
prompts and exits, ``xinfer plugins [--json]`` lists plugins. Each takes ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict


def main(argv: Sequence[str] | None = None) -> int:
    """The program (``argv`` None: the command line's) or a command run in-process (``argv`` given)."""
    try:
        return _run(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:  # the reader went away (xinfer plugins --json | head): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush stays quiet
        return 0
    except KeyboardInterrupt:  # Ctrl+C while the model loads or the prompts run (the server handles its own)
        print("\nxinfer: interrupted", file=sys.stderr)
        return 130
    finally:
        if argv is None:
            exit_at_next_interrupt()


def exit_at_next_interrupt() -> None:
    """The program's exit (its threads joined, the engine's memory freed) takes a moment: a Ctrl+C in it, often
    the second of a double Ctrl+C, ends the process at once instead of printing a traceback from the interpreter.
    Only the main thread can set a signal handler: elsewhere (a command run in-process) nothing changes."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))


COMMANDS = ("serve", "chat", "plugins")


def _run(argv: list[str]) -> int:
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command is not None and command not in COMMANDS:
        print(
            f"xinfer: unknown command {command!r}: choose one of {', '.join(COMMANDS)} (xinfer --help)", file=sys.stderr
        )
        return 2
    if command == "plugins":
        return list_plugins(as_json=plugins_parser().parse_args(argv[1:]).json)
    from xinfer.server.args import CHAT, SERVE, parse_args
    from xinfer.server.launch import setup_logging

    prog = f"xinfer {command}" if command else "xinfer"
    args = parse_args(argv[1:] if command else argv, prog, CHAT if command == "chat" else SERVE)
    setup_logging(args)
    if command == "chat" or args.interactive or args.prompts:
        from xinfer.chat import run

        return run(args)
    from xinfer.server.launch import run

    return run(args)


def plugins_parser() -> argparse.ArgumentParser:
    from xinfer.server.args import Parser

    parser = Parser(
        prog="xinfer plugins",
        allow_abbrev=False,
        description="List the installed xinfer plugins (entry points of the group xinfer): each one's name, version "
        "and hooks, what it registers (architectures, GGUF architectures, backends and whether each backend can run "
        "on this machine), and the plugins that failed to load with their error. XINFER_PLUGINS=a,b loads only "
        "those named.",
    )
    parser.add_argument("--json", action="store_true", help="print the same as a JSON list, for scripts")
    return parser


def list_plugins(as_json: bool = False) -> int:
    from xinfer import registry

    infos = registry.plugins()
    print(json.dumps([asdict(info) for info in infos], indent=2) if as_json else describe(infos))
    sys.stdout.flush()
    return 0


def describe(infos: list) -> str:
    if not infos and (chosen := os.environ.get("XINFER_PLUGINS")):
        return f"no plugin loaded: XINFER_PLUGINS={chosen} names none of those installed (unset it to list them)"
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
