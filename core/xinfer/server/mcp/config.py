"""Which MCP servers to start: ``--mcp-command``/``--mcp-args`` (one, named ``mcp``) and
``--mcp-config FILE`` in the format Claude Desktop and other clients use::

    {"mcpServers": {"NAME": {"command": "...", "args": ["..."], "env": {"KEY": "VALUE"}}}}

Only stdio servers (a ``command``) are supported; a bad file is a one-line error at startup.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xinfer.server.mcp.client import MCPHub

COMMAND_SERVER_NAME = "mcp"  # the name of the --mcp-command server (in requests' "mcp" lists)


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None


@dataclass
class MCPSettings:
    """The servers' connections and what the flags say to do with their tools' calls."""

    hub: MCPHub
    run_calls: bool = True  # --mcp-tool-calls server: run them here; client: return them
    max_rounds: int = 8  # --mcp-max-rounds


def server_specs(command: str | None, args: str | None, config: str | None) -> list[ServerSpec]:
    """The servers the flags name; ValueError (one line) on a bad flag or file."""
    specs = read_config(Path(config)) if config else []
    if args and not command:
        raise ValueError("--mcp-args needs --mcp-command")
    if command is not None:
        if not command.strip():
            raise ValueError("--mcp-command: empty (the program an MCP server runs)")
        if any(spec.name == COMMAND_SERVER_NAME for spec in specs):
            raise ValueError(f"--mcp-config names a server {COMMAND_SERVER_NAME!r}, the name of --mcp-command's")
        check_program(command, "--mcp-command")
        try:
            arguments = shlex.split(args or "")
        except ValueError as error:  # an unbalanced quote
            raise ValueError(f"--mcp-args {args!r}: {str(error).lower()} (split as a shell would)") from None
        specs.append(ServerSpec(COMMAND_SERVER_NAME, command, arguments))
    return specs


def check_program(command: str, where: str, env: dict[str, str] | None = None) -> None:
    """The program a server runs exists (else every request that uses its tools would fail, not start-up)."""
    if shutil.which(command, path=(env or {}).get("PATH", os.environ.get("PATH"))) is None:
        raise ValueError(f"{where}: no program {command!r} (not a path to one, and not found on PATH)")


def read_config(path: Path) -> list[ServerSpec]:
    where = f"--mcp-config {path}"
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"{where}: cannot be read ({error.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ValueError(f'{where}: expected {{"mcpServers": {{"NAME": {{"command": ..., "args": [...]}}}}}}')
    return [server_spec(name, entry, f"{where}: mcpServers.{name}") for name, entry in servers.items()]


def server_spec(name: str, entry: object, where: str) -> ServerSpec:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    if "command" not in entry:
        kind = "a URL server" if "url" in entry else "a server without a command"
        raise ValueError(f"{where} is {kind}; only stdio servers (command, args, env) are supported")
    command, args, env = entry["command"], entry.get("args", []), entry.get("env")
    if not isinstance(command, str) or not command:
        raise ValueError(f"{where}.command must be a non-empty string")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{where}.args must be a list of strings")
    if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ValueError(f"{where}.env must map names to strings")
    check_program(command, f"{where}.command", env)
    return ServerSpec(name, command, list(args), env)
