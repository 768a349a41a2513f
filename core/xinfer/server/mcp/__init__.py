"""MCP (Model Context Protocol) tools for the server, through the official ``mcp`` SDK:
stdio servers named by ``--mcp-command``/``--mcp-args`` or ``--mcp-config``, their tools
offered to the model on requests that ask for them, and the model's calls to them run here.

:mod:`.config` reads the flags and the config file (no SDK needed); :mod:`.client` holds the
connections (importing the SDK); :mod:`.loop` runs a request's rounds of calls.
"""
