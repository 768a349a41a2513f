"""Starting the server: resolve the model, build the engine (on its own thread),
run the API (and the UI) under uvicorn, and shut down gracefully on SIGTERM.

SIGTERM (or Ctrl+C) stops accepting connections, answers new requests on open
connections with 503, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then aborts the rest (each gets a 503, or its stream an
error event, after what it was sent) and exits 0. A second Ctrl+C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

import uvicorn
from pydantic import ValidationError

from xinfer.config import EngineConfig
from xinfer.engine.async_engine import AsyncEngine, EngineState
from xinfer.engine.engine import LLMEngine
from xinfer.loading.errors import first_line
from xinfer.sampling import recommended_sampling
from xinfer.server.app import build_app
from xinfer.server.in_flight import InFlight
from xinfer.server.mcp.config import MCPSettings, ServerSpec, server_specs
from xinfer.server.media import MediaPolicy, parse_limits
from xinfer.server.metrics import Metrics
from xinfer.server.params import SamplingDefaults
from xinfer.server.serving import Serving

log = logging.getLogger("xinfer")

STREAM_FLUSH_SECONDS = 2


def model_source(args: argparse.Namespace) -> str | None:
    """What ``--w`` or ``--m`` names, before resolution (None: ``--f`` alone, or the default model)."""
    return args.weights or args.model


def prepare(args: argparse.Namespace) -> tuple[Path, EngineConfig]:
    """The model's local path (downloaded first if ``--m`` is a hub id) and the engine's config, checked as far
    as they can be before the engine is built (:func:`xinfer.engine.build.check_start`): a bad model or value
    ends the command here in one line (its traceback at ``--log debug``), before anything starts."""
    from xinfer.engine.build import check_start
    from xinfer.loading.resolve import resolve_model_path

    try:
        path = resolve_model_path(model_source(args), args.gguf_file)
        config = engine_config(args, path)
        check_start(config)
        media_policy(args)  # a bad image flag ends here too
        return path, config
    except (ValueError, FileNotFoundError, NotImplementedError) as error:  # the last: a config value not served
        refuse(error)


def refuse(error: Exception) -> NoReturn:
    """Ends the command in one line saying what is wrong (its traceback at ``--log debug``)."""
    log.debug("refused", exc_info=True)
    print(f"xinfer: {one_line(error)}", file=sys.stderr)
    raise SystemExit(2) from None


def listen(host: str, port: int, flag: str = "--port") -> list[socket.socket]:
    """Sockets listening on ``host``'s addresses at ``port`` (0: a free one), bound before the model loads so
    that an address in use or a host that is not this machine's ends the command at once, in one line."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host}: not an address to listen on ({error.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio does: the IPv4 address gets its own socket
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            sock.listen(2048)
            port = sock.getsockname()[1]  # with port 0, the host's other addresses take the one the first got
    except OSError as error:
        for sock in sockets:
            sock.close()
        why = f"another process listens there (choose another {flag})" if error.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}{f'; {why}' if why else ''}") from None
    return sockets


def one_line(error: Exception) -> str:
    """``error`` on one line: a config's validation errors as the flags they come from."""
    if not isinstance(error, ValidationError):
        return str(error)
    return "; ".join(
        f"--{str(e['loc'][-1]).replace('_', '-')} {e['input']}: {e['msg'][:1].lower()}{e['msg'][1:]}"
        for e in error.errors()
    )


def mcp_servers(args: argparse.Namespace) -> list[ServerSpec]:
    """The MCP servers the flags name; a bad flag or config file ends the command in one line."""
    try:
        return server_specs(args.mcp_command, args.mcp_args, args.mcp_config)
    except ValueError as error:
        print(f"xinfer: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def mcp_settings(args: argparse.Namespace, specs: list[ServerSpec]) -> MCPSettings | None:
    if not specs:
        return None
    from xinfer.server.mcp.client import MCPHub  # the SDK, imported only where MCP servers are configured

    hub = MCPHub(specs, args.mcp_timeout)
    return MCPSettings(hub, run_calls=args.mcp_tool_calls == "server", max_rounds=args.mcp_max_rounds)


def setup_logging(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def device_ids(args: argparse.Namespace) -> list[int] | None:
    """The ids ``--d`` names (with ``--cpu``, CPU ranks). Where the machine's accelerator is always a
    single device (a Mac's GPU: its backend's ``one_device``), there is nothing to choose or split
    over: other ids than 0 are ignored with a warning. Ids past the devices found are refused."""
    if not args.devices or args.cpu:
        return args.devices
    import torch

    from xinfer import registry

    ids = ",".join(map(str, args.devices))
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        raise ValueError(f"--d {ids} names an accelerator, and this machine has none: run without --d (or --cpu)")
    one_device = any(spec.one_device for spec in registry.backends() if spec.device_type == accelerator.type)
    if one_device and args.devices != [0]:
        log.warning("--d %s ignored: this machine's accelerator (%s) is one device", ids, accelerator.type)
        return [0]
    count = torch.accelerator.device_count()
    if max(args.devices) >= count:
        found = ", ".join(f"{accelerator.type}:{i}" for i in range(count)) or "none"
        raise ValueError(f"--d {ids} names {accelerator.type} devices this machine lacks: it has {count} ({found})")
    return args.devices


def device_of(args: argparse.Namespace, ids: list[int] | None) -> str:
    """The engine's device: the CPU, this rank's accelerator of ``ids`` (:func:`device_ids`), or auto."""
    if args.cpu:
        return "cpu"
    if ids:
        import torch

        accelerator = torch.accelerator.current_accelerator()
        assert accelerator is not None, "device_ids checked it"
        return str(torch.device(accelerator.type, ids[0]))  # under tensor parallelism, each rank its own
    return "auto"


def parallel_options(args: argparse.Namespace, ids: list[int] | None) -> dict:
    """Tensor parallelism: as many ranks per node as ``ids`` (:func:`device_ids`) names (on the CPU, ranks)."""
    per_node = len(ids) if ids else 1
    accelerators = ids if ids and not args.cpu else None
    return dict(tensor_parallel_size=per_node * args.num_nodes, device_ids=accelerators, num_nodes=args.num_nodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                timeout=args.tp_timeout)  # fmt: skip


def engine_config(args: argparse.Namespace, path: Path) -> EngineConfig:
    ids = device_ids(args)
    return EngineConfig.from_kwargs(
        model=str(path),
        dtype=args.dtype,
        load_format=args.load_format,
        isq=args.isq,
        hf_overrides=args.hf_overrides,
        mm_processor_kwargs=args.mm_processor_kwargs,
        max_model_len=args.max_model_len,
        seed=args.seed if args.seed is not None else 0,
        kv_fraction=args.kv_fraction,
        kv_cache_dtype=args.kvcache_dtype,
        kv_recent_window=args.kv_recent_window,
        enable_prefix_caching=not args.disable_prefix_cache,
        mamba_fraction=args.mamba_fraction,
        state_snapshot_interval=args.state_snapshot_interval,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.prefill_chunk_size,
        encoder_cache_size=args.encoder_cache_size,
        device=device_of(args, ids),
        enforce_eager=args.disable_cuda_graph,
        **parallel_options(args, ids),
    )


def served_names(args: argparse.Namespace, path: Path) -> tuple[str, frozenset[str]]:
    """The model's name in the API, and other names requests may use for it."""
    source = model_source(args) or args.gguf_file
    name = args.served_model_name or source or path.stem
    aliases = {n for n in (source, args.model, args.gguf_file, str(path), path.name, path.stem) if n}
    return name, frozenset(aliases - {name})


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """Where images may come from, how many and how large (--limit-mm-per-prompt, ...)."""
    local = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    if local is not None and not local.is_dir():
        raise ValueError(f"--allowed-local-media-path {local}: not a directory")
    try:
        limits = parse_limits(args.limit_mm_per_prompt)
    except ValueError as error:
        raise ValueError(f"--limit-mm-per-prompt: {error}") from None
    return MediaPolicy(local, args.allow_remote_media, limits, args.max_image_pixels)


def sampling_defaults(args: argparse.Namespace, path: Path) -> SamplingDefaults:
    """``--temperature``, ``--top-k``, ... (each flag named as its field) where given, else the model's
    recommended sampling (``--generation-config``), else :class:`SamplingDefaults`'."""
    recommended = recommended_sampling(args.generation_config, path)
    if recommended:
        log.info("sampling defaults from the model's generation config: %s (flags and requests override them%s)",
                 ", ".join(f"{name}={value}" for name, value in recommended.items()),
                 "; max_tokens also caps what a request asks for, as vLLM" if "max_tokens" in recommended else "")  # fmt: skip
    recommended["recommended_max_tokens"] = recommended.pop("max_tokens", None) if args.max_tokens is None else None
    given = {f.name: getattr(args, f.name, None) for f in fields(SamplingDefaults)}  # (no flag: recommended_*)
    return SamplingDefaults(**recommended | {name: value for name, value in given.items() if value is not None})


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: :class:`GracefulShutdown` owns SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@dataclass
class GracefulShutdown:
    engine: AsyncEngine
    in_flight: InFlight  # the HTTP requests being answered: a request between MCP rounds is not the engine's
    servers: Sequence[uvicorn.Server]
    timeout: float
    exit_code: int = 0
    reason: str | None = None  # why the server ends on its own, said last in one line
    task: asyncio.Task | None = None

    def trigger(self, sig: int | None = None) -> None:
        if self.engine.state is EngineState.LOADING and sig is not None:
            # nothing to drain, and a load cannot be cut short: end now, the loading thread with the process
            self.exit_code, self.reason = 128 + sig, "interrupted while loading the model"
            for server in self.servers:
                server.should_exit = server.force_exit = True
            return
        if self.task is None:
            log.info("shutting down: finishing in-flight requests (up to %.0f s)", self.timeout)
            self.task = asyncio.ensure_future(self.drain())
        elif sig == signal.SIGINT:
            log.info("second interrupt: exiting now")
            self.engine.abort_all()
            for server in self.servers:
                server.should_exit = server.force_exit = True

    async def drain(self) -> None:
        self.engine.begin_drain()
        self.in_flight.begin_drain()
        for server in self.servers:
            for listener in getattr(server, "servers", []):
                listener.close()
        deadline = time.monotonic() + self.timeout
        answered = await self.in_flight.wait_idle(self.timeout)
        if not answered or not await self.engine.wait_idle(max(0.0, deadline - time.monotonic())):
            log.warning("shutdown timeout: aborting %d request(s)", self.engine.num_in_flight)
            self.engine.abort_all()
            await self.engine.wait_idle(STREAM_FLUSH_SECONDS)
        for server in self.servers:
            server.should_exit = True

    def fail(self, code: int, reason: str) -> None:
        self.exit_code, self.reason = code, reason
        self.timeout = 0
        self.trigger()


def uvicorn_config(app: Any, args: argparse.Namespace) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="off",
        timeout_graceful_shutdown=STREAM_FLUSH_SECONDS,
        timeout_keep_alive=5,
    )


def async_engine(args: argparse.Namespace, config: EngineConfig) -> AsyncEngine:
    """The engine serving requests; with ``--pd-client``, one whose prompts the prefill server prefills."""
    options = dict(max_waiting=args.max_waiting, stall_timeout=args.health_stall_timeout)
    if not args.pd_client:
        return AsyncEngine(lambda: LLMEngine(config), **options)
    from xinfer.distributed.pd import DisaggregatedEngine

    return DisaggregatedEngine(lambda: LLMEngine(config), **options, url=args.pd_url,
                               fallback_local=args.pd_fallback == "local", timeout=args.pd_timeout,
                               transport=args.pd_transport, api_key=args.api_key)  # fmt: skip


def listeners(args: argparse.Namespace) -> list[list[socket.socket]]:
    """The API's sockets, and with ``--ui-server`` the UI's; an address that cannot be had ends the command."""
    ports = [args.port] + ([args.ui_port or (args.port + 1 if args.port else 0)] if args.ui_server else [])
    if len(ports) == 2 and ports[0] and ports[0] == ports[1]:
        refuse(ValueError(f"--ui-port {ports[1]} is the API's --port: the chat UI needs a port of its own"))
    sockets: list[list[socket.socket]] = []
    try:
        for port, flag in zip(ports, ["--port", "--ui-port"]):
            sockets.append(listen(args.host, port, flag))
    except ValueError as error:
        for sock in (sock for group in sockets for sock in group):
            sock.close()
        refuse(error)
    return sockets


async def serve(
    args: argparse.Namespace,
    path: Path,
    config: EngineConfig,
    sockets: Sequence[list[socket.socket]],
    mcp_specs: Sequence[ServerSpec] = (),
) -> int:
    loop = asyncio.get_running_loop()
    engine = async_engine(args, config)
    metrics = Metrics(engine)
    engine.on_request_done = metrics.request_done
    name, aliases = served_names(args, path)
    mcp = mcp_settings(args, list(mcp_specs))
    serving = Serving(engine, name, str(path), sampling_defaults(args, path), metrics, aliases, media=media_policy(args),
                      reasoning_parser=args.reasoning_parser, disable_reasoning=args.disable_reasoning,
                      tool_parser=args.enforce_parser, mcp=mcp)  # fmt: skip
    in_flight = InFlight()
    app = build_app(serving, args.api_key, args.max_body_bytes, allowed_origins=args.allowed_origins,
                    in_flight=in_flight)  # fmt: skip
    if args.pd_server:
        from xinfer.distributed.pd import PrefillServer

        app.include_router(PrefillServer(engine, args.pd_timeout, args.pd_transport).router())
    apps = [app]
    if args.ui_server:
        apps.append(build_app(serving, args.api_key, args.max_body_bytes, True, args.allowed_origins, in_flight))
    servers = [_Server(uvicorn_config(each, args)) for each in apps]
    shutdown = GracefulShutdown(engine, in_flight, servers, args.shutdown_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.trigger, sig)
    log.info("loading %s", path)
    engine.start(loop)
    watcher = asyncio.ensure_future(_exit_if_loading_fails(engine, shutdown))
    connecting = asyncio.ensure_future(mcp.hub.start()) if mcp is not None else None  # requests wait for theirs
    for what, group in zip(["API", "chat UI"], sockets):
        host, port = group[0].getsockname()[:2]
        log.info("serving the %s on http://%s:%d", what, f"[{host}]" if ":" in host else host, port)
    try:
        await asyncio.gather(*(server.serve(list(group)) for server, group in zip(servers, sockets)))
    finally:
        watcher.cancel()
        engine.stop(timeout=0 if engine.state is EngineState.LOADING else 10)
        if mcp is not None:
            assert connecting is not None
            connecting.cancel()
            await mcp.hub.close()
    if shutdown.reason is not None:  # after the servers' own lines: the last line says why
        print(f"xinfer: {shutdown.reason}", file=sys.stderr)
    if engine.running:  # an interrupted load, which nothing stops: the interpreter's exit under it would abort
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(shutdown.exit_code)
    return shutdown.exit_code


async def _exit_if_loading_fails(engine: AsyncEngine, shutdown: GracefulShutdown) -> None:
    # polled, not awaited in an executor's thread: asyncio.run joins those at exit, so an interrupted load would
    # hold the process until it ended
    while not engine.wait_loaded(0):
        await asyncio.sleep(0.1)
    if engine.state is EngineState.DEAD:  # the engine thread logged why
        why = first_line(engine.error or "").removeprefix("loading failed: ")
        shutdown.fail(1, f"the model could not be loaded: {why}")
        return
    log.info("model loaded; serving")
    while engine.running:
        await asyncio.sleep(0.5)
    if engine.state is EngineState.DEAD:  # e.g. a tensor-parallel worker died: its requests have failed
        shutdown.fail(1, f"the engine died: {engine.error}")


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    specs = mcp_servers(args)
    path, config = prepare(args)
    if config.parallel.node_rank > 0:  # this node's ranks follow node 0's engine
        from xinfer.distributed.worker import run_node

        return run_node(config)
    return asyncio.run(serve(args, path, config, listeners(args), specs))
