"""xinfer's command-line flags (xInfer's names), each also settable as ``XINFER_<FLAG>``.

A flag given on the command line wins over its environment variable. Flags of
features that arrive later are listed in ``--help`` and refused with one line.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from argparse import SUPPRESS
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from xinfer.kv.formats import formats
from xinfer.sampling import SamplingParams, check_generation_config
from xinfer.text.reasoning import PARSERS
from xinfer.toolcalls import PARSERS as TOOL_PARSERS

ENV_PREFIX = "XINFER_"
DTYPE_NAMES = ["auto", "bf16", "bfloat16", "f16", "fp16", "float16", "half", "f32", "fp32", "float32", "float"]
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


def _at_least(kind: type, minimum: float) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, refused below ``minimum``."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not value >= minimum:  # nan too
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _share(text: str) -> float:
    """An argparse type: a share strictly between 0 and 1."""
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (both excluded), got {text}")
    return value


_share.__name__ = "float"


def _port(lowest: int) -> Callable[[str], int]:
    """An argparse type: a TCP port, ``lowest`` (0: any free one) to 65535."""

    def parse(text: str) -> int:
        value = int(text)
        if not lowest <= value <= 65535:
            raise argparse.ArgumentTypeError(f"must be a port from {lowest} to 65535, got {text}")
        return value

    parse.__name__ = "int"
    return parse


# flags vLLM has and xinfer names otherwise: what to give instead
VLLM_FLAGS = {
    "--kv-cache-dtype": "--kvcache-dtype",
    "--gpu-memory-utilization": "--kv-fraction",
    "--tensor-parallel-size": "--d with one id per device (--d 0,1)",
    "--max-num-batched-tokens": "--prefill-chunk-size",
    "--enforce-eager": "--disable-cuda-graph",
    "--quantization": "--isq (a quantized checkpoint's format is read from its files)",
    "--device": "--cpu, or --d",
    "--enable-prefix-caching": "nothing (on by default)",
    "--no-enable-prefix-caching": "--disable-prefix-cache",
}


class Parser(argparse.ArgumentParser):
    """argparse, its errors one line (argparse prints the whole usage first, dozens of lines here); a flag it
    does not know gets what to give instead: xinfer's name of a vLLM flag, or the closest flag."""

    def error(self, message: str) -> NoReturn:
        hint = ""
        if message.startswith("unrecognized arguments:"):
            hints = [self._instead(word.split("=")[0]) for word in message.split()[2:] if word.startswith("--")]
            hint = "; ".join(h for h in hints if h)
        self.exit(2, f"{self.prog}: {message}{f' ({hint})' if hint else ''} (see {self.prog} --help)\n")

    def _instead(self, flag: str) -> str | None:
        if flag in VLLM_FLAGS:
            return f"{flag} is vLLM's flag: give {VLLM_FLAGS[flag]}"
        close = difflib.get_close_matches(flag, [o for o in self._option_string_actions if o.startswith("--")], 1)
        return f"did you mean {close[0]}?" if close else None


SERVE = """Serve an LLM with an OpenAI-compatible API on --port, and the chat UI with --ui-server
(the embedded SmolLM2-135M-Instruct when no model is given)."""
CHAT = """Chat with an LLM in the terminal (the embedded SmolLM2-135M-Instruct when no model is given).
The serving flags are accepted and unused."""
COMMANDS = """commands:
  xinfer [serve] [FLAGS]      serve the API (python -m xinfer.server [FLAGS] too)
  xinfer chat [FLAGS]         chat in the terminal, as --i (python -m xinfer.chat [FLAGS] too)
  xinfer --prompts "A|B"      answer the prompts, print the answers and the speed, exit
  xinfer plugins [--json]     list the installed plugins, their registrations and backends

Every flag can also be set as an environment variable XINFER_<FLAG> (XINFER_MAX_NUM_SEQS=8, XINFER_CPU=1);
the command line wins."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one worth reading (0 is, None and off are not); keeps the epilog's
    lines."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser(prog: str = "xinfer", description: str = SERVE) -> argparse.ArgumentParser:
    # fmt: off
    p = Parser(prog=prog, formatter_class=_HelpFormatter, allow_abbrev=False,
                                description=description, epilog=COMMANDS)
    model = p.add_argument_group("model")
    model.add_argument("--m", "--model", dest="model", metavar="ID_OR_PATH",
                       help="Hugging Face hub id (org/name: downloaded into the hub's cache, HF_TOKEN and "
                       "HF_HUB_OFFLINE apply), HF model folder, GGUF file, or folder holding one (default: embedded "
                       "SmolLM2)")
    model.add_argument("--w", dest="weights", metavar="PATH",
                       help="a local folder of an HF safetensors checkpoint (xInfer's name for a local --m; wins "
                       "over --m)")
    model.add_argument("--f", dest="gguf_file", metavar="FILE",
                       help="GGUF file, or the one to use of those in the --m folder or hub repository")
    model.add_argument("--served-model-name", metavar="NAME", help="model name in the API (default: from the path)")
    model.add_argument("--dtype", default="auto", choices=DTYPE_NAMES, metavar="DTYPE",
                       help="dtype of the weights that are not packed and of the activations: auto (the checkpoint's bf16 or f16, else bf16; f32 on "
                       "the CPU), bf16, f16 or f32 (also: bfloat16, fp16, float16, half, fp32, float32, float)")
    model.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"],
                       help="how to read the weights: auto (a GGUF file as GGUF, else the safetensors), safetensors, gguf, "
                       "or dummy (random weights of the right shapes, for benchmarks: no weight file needed)")
    model.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                       help="fields of the model's config.json replaced, as a JSON object (a sub-config's, such as "
                       "text_config, merged field by field), e.g. Qwen3's YaRN recipe for 131,072 tokens: "
                       "'{\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0, "
                       "\"original_max_position_embeddings\": 32768}}'")
    model.add_argument("--mm-processor-kwargs", type=_json_object, metavar="JSON",
                       help="a model that takes images: its image processor's settings (preprocessor_config.json's "
                       "fields) replaced, as a JSON object, e.g. fewer tokens an image for Qwen-VL: "
                       "'{\"max_pixels\": 802816}', or Gemma 4's '{\"max_soft_tokens\": 140}'")
    model.add_argument("--isq", metavar="TYPE",
                       help="quantize a float checkpoint's weights at load into a packed format, run as quantized "
                       "checkpoints are: q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, q4_1, q4_0, q3_k, q2_k, fp8, mxfp4, nvfp4; "
                       "or w2, the MoE experts alone in q2_k (2.625 bits a value)")

    device = p.add_argument_group("device")
    device.add_argument("--d", dest="devices", metavar="IDS", type=_device_ids,
                        help="device ids, e.g. 0; several (0,1) split the model over them, one process each (tensor "
                        "parallel, docs/distributed.md); with --cpu, as many CPU ranks as ids; ignored with a warning where "
                        "the accelerator is one device (a Mac's GPU)")
    device.add_argument("--cpu", action="store_true",
                        help="run on the CPU even where a GPU is available (default: the available backend of highest "
                        "priority, a GPU's where one is available, else the CPU)")
    device.add_argument("--disable-cuda-graph", action="store_true",
                        help="run every step eagerly instead of replaying recorded CUDA graphs (slower decode; "
                        "quicker start-up, less memory)")

    capacity = p.add_argument_group("capacity")
    capacity.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences in a running batch (default: as many as the KV "
                          "cache holds at 1024 tokens each, or --max-model-len if shorter, at most 256)")
    capacity.add_argument("--max-model-len", type=int, metavar="TOKENS",
                          help="context limit, prompt and answer together, in tokens (default: the model's)")
    capacity.add_argument("--kv-fraction", type=float, metavar="SHARE",
                          help="GPU: share of the device's total memory (on a Mac: of the memory Metal lets one process "
                          "keep resident) for weights, activations, CUDA graphs and KV cache, which gets the rest "
                          "(default: 0.9); CPU: share of the available RAM after loading "
                          "the weights for the KV cache (default: a quarter, at most 2 GiB)")
    capacity.add_argument("--kvcache-dtype", default="auto", choices=list(formats()),
                          help="KV cache format (docs/kv-cache.md): auto (the model dtype, unquantized), fp8 (e4m3), "
                          "TurboQuant's rotated codes turbo8 (8-bit keys, 4-bit values), turbo4 (4-bit both), turbo3 "
                          "(3-bit keys, 4-bit values), turbo4-lm and turbo3-lm (Lloyd-Max key levels), and the "
                          "formats plugins register")
    capacity.add_argument("--kv-recent-window", type=int, default=0, metavar="N",
                          help="with a quantized --kvcache-dtype: keys and values of each query's last N positions and "
                          "of its sequence's first block are read unquantized, from shadow blocks in the model dtype "
                          "(CPU and CUDA backends); 0: off")
    capacity.add_argument("--prefill-chunk-size", type=_at_least(int, 1), default=8192, metavar="TOKENS",
                          help="most tokens in one step (default: 8192); a longer prompt is prefilled in chunks")
    capacity.add_argument("--disable-prefix-cache", action="store_true",
                          help="do not reuse the KV cache of a prompt prefix seen before (default: reused, in "
                          "16-token blocks)")
    capacity.add_argument("--mamba-fraction", type=_share, metavar="SHARE",
                          help="models with recurrent layers (Gated DeltaNet, Mamba): share of the cache memory for "
                          "the per-sequence recurrent states, which bounds how many sequences run at once "
                          "(docs/cache-kinds.md; default: a slot for every sequence the KV cache holds, at most half)")
    capacity.add_argument("--state-snapshot-interval", type=_at_least(int, 1), default=1024, metavar="N",
                          help="models with recurrent layers, with prefix caching: snapshot a prompt's recurrent state "
                          "every N tokens (rounded down to a multiple of the KV block size, at least one block) and at "
                          "its last block boundary, where later prompts with the same prefix resume "
                          "(docs/cache-kinds.md); smaller: more hits mid-prompt, more snapshot copies")

    media = p.add_argument_group("images (models that take them)")
    media.add_argument("--limit-mm-per-prompt", default="image=4", metavar="LIMITS",
                       help="most items of each modality in one request: image=N (vLLM's JSON {\"image\": N} too)")
    media.add_argument("--max-image-pixels", type=_at_least(int, 1), default=4096 * 4096, metavar="PIXELS",
                       help="a request with a larger image (width x height, in pixels) gets 400")
    media.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="let requests name images as file:// URLs of files under DIR (default: none)")
    media.add_argument("--allow-remote-media", action="store_true",
                       help="fetch images requests name by http(s) URL (default: refused; send data: URLs)")
    media.add_argument("--encoder-cache-size", type=_at_least(int, 0), default=8192, metavar="N",
                       help="image encoder outputs kept for images seen again, in embedding rows (a Gemma 3 image: "
                       "256)")

    sampling = p.add_argument_group(
        "sampling defaults (a request's own values win; a flag not given takes the model's recommendation, "
        "--generation-config, else the value below)"
    )
    sampling.add_argument("--generation-config", default="auto", metavar="SOURCE",
                          help="where the recommended sampling comes from: auto (the model folder's "
                          "generation_config.json: its temperature, top_k, top_p, min_p, repetition_penalty and "
                          "max_new_tokens, as vLLM applies them), none (these flags' defaults; vLLM's 'vllm' too), or "
                          "a folder holding a generation_config.json")
    sampling.add_argument("--temperature", type=float, metavar="T",
                          help="divides the logits before sampling; 0: greedy (the likeliest token) (default: 1)")
    sampling.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens; 0: all (default)")
    sampling.add_argument("--top-p", type=float, metavar="P",
                          help="sample among the likeliest tokens whose probabilities add up to P (nucleus); 1: all "
                          "(default)")
    sampling.add_argument("--min-p", type=float, metavar="P",
                          help="sample among tokens at least P times as likely as the likeliest; 0: all (default)")
    sampling.add_argument("--repetition-penalty", type=float, metavar="VALUE",
                          help="divides a positive logit (multiplies a negative one) of every token of the prompt or "
                          "the answer so far; 1: off (default)")
    sampling.add_argument("--frequency-penalty", type=float, metavar="VALUE",
                          help="-2 to 2: subtracted from a token's logit once per time it was generated; 0: off "
                          "(default)")
    sampling.add_argument("--presence-penalty", type=float, metavar="VALUE",
                          help="-2 to 2: subtracted from the logit of every token generated at least once; 0: off "
                          "(default)")
    sampling.add_argument("--max-tokens", type=int, metavar="N",
                          help="tokens generated for a request that sets no max_tokens (default: 16 on "
                          "/v1/completions, as OpenAI's; the rest of the context on the other routes; 1024 in the "
                          "terminal chat)")
    sampling.add_argument("--seed", type=int, metavar="N",
                          help="seed of requests that send none, and of the engine's sampler (default: each request "
                          "draws a seed of its own from the engine's, 0)")

    serving = p.add_argument_group("serving")
    serving.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="address to listen on (0.0.0.0: every interface)")
    serving.add_argument("--port", type=_port(0), default=8000, help="port of the API (/v1/...)")
    serving.add_argument("--ui-server", action="store_true", help="also serve the chat UI on --ui-port")
    serving.add_argument("--ui-port", type=_port(0), metavar="PORT", help="port of the chat UI (default: --port + 1)")
    serving.add_argument("--api-key", metavar="KEY",
                         help="require this key on every API request, sent as Authorization: Bearer KEY or x-api-key: "
                         "KEY (default: no key); /health, /metrics and the chat UI's files stay open, and the UI port "
                         "hands the key to its page")
    serving.add_argument("--allowed-origins", nargs="*", default=["*"], metavar="ORIGIN",
                         help="origins whose pages' scripts may call the API (CORS), e.g. https://app.example.com "
                         "(default: every origin, *; none given: no CORS headers)")
    serving.add_argument("--max-waiting", type=_at_least(int, 1), default=256, metavar="N",
                         help="sequences waiting to start (beyond the running batch's room) past which a new request "
                         "gets 429; also the most one request may ask for (its prompts times n), beyond which it "
                         "gets 400")
    serving.add_argument("--shutdown-timeout", type=_at_least(float, 0), default=30.0, metavar="SECONDS",
                         help="seconds in-flight requests may take to finish after SIGTERM")
    serving.add_argument("--max-body-bytes", type=_at_least(int, 1), default=16 << 20, metavar="BYTES",
                         help="a larger request body gets 413")
    serving.add_argument("--health-stall-timeout", type=_at_least(float, 0), default=300.0, metavar="SECONDS",
                         help="a step running longer makes /health answer 503")
    serving.add_argument("--log-level", "--log", default="info", choices=["debug", "info", "warning", "error"],
                         help="log detail (debug: with the traceback of an error)")
    serving.add_argument("--access-log", action="store_true", help="log every HTTP request")

    reasoning = p.add_argument_group("reasoning (<think> blocks split into reasoning_content)")
    reasoning.add_argument("--reasoning-parser", default="auto", choices=["auto", "none", *PARSERS], metavar="NAME",
                           help="how answers' reasoning is split out: auto (models whose chat template writes "
                                "</think>, which is one token), none, or a family's parser: " + ", ".join(PARSERS))
    reasoning.add_argument("--disable-reasoning", action="store_true",
                           help="ask templates not to think (enable_thinking=false) and split nothing")

    mcp = p.add_argument_group("MCP tools (offered on /v1/messages and /v1/chat/completions requests with "
                                "\"mcp\": true or a list of server names)")
    mcp.add_argument("--mcp-command", metavar="CMD", help="an MCP stdio server to start, named \"mcp\"")
    mcp.add_argument("--mcp-args", metavar="ARGS", help="--mcp-command's arguments, one string split as a shell does")
    mcp.add_argument("--mcp-config", metavar="FILE",
                     help='MCP stdio servers in the JSON format Claude Desktop uses: '
                     '{"mcpServers": {"NAME": {"command": ..., "args": [...], "env": {...}}}}')
    mcp.add_argument("--mcp-tool-calls", default="server", choices=["server", "client"],
                     help="server: run the model's calls of MCP tools and feed their results back until it answers; "
                     "client: return them to the client as tool calls")
    mcp.add_argument("--mcp-max-rounds", type=_at_least(int, 1), default=8, metavar="N",
                     help="with --mcp-tool-calls server: rounds of tool calls per request, after which the model "
                     "answers with no tools")
    mcp.add_argument("--mcp-timeout", type=_at_least(float, 0.1), default=30.0, metavar="SECONDS",
                     help="seconds an MCP server may take to start or to answer a call (then the request fails)")

    tools = p.add_argument_group("tool calling (tools and tool_choice on chat completions)")
    tools.add_argument("--enforce-parser", default="auto", choices=["auto", "none", *TOOL_PARSERS], metavar="NAME",
                       help="how answers' tool calls are read: auto (the format the model's chat template writes), "
                            "none (answers are text), or a format's parser: " + ", ".join(TOOL_PARSERS))

    nodes = p.add_argument_group("multi-node tensor parallel (the same command on every node, each with its "
                                 "--node-rank; node 0 serves, the others follow it)")
    nodes.add_argument("--num-nodes", type=_at_least(int, 1), default=1, metavar="N",
                       help="machines sharing the ranks, each running --d's devices")
    nodes.add_argument("--node-rank", type=_at_least(int, 0), default=0, metavar="RANK",
                       help="this machine's place, 0 to --num-nodes - 1")
    nodes.add_argument("--master-addr", default="127.0.0.1", metavar="ADDRESS",
                       help="node 0's address, where the ranks meet")
    nodes.add_argument("--master-port", type=_port(1), metavar="PORT", help="the port they meet at on node 0 (needed with "
                       "--num-nodes above 1; default on one node: a free one)")
    nodes.add_argument("--tp-timeout", type=_at_least(float, 1), default=300.0, metavar="SECONDS",
                       help="seconds a rank waits for the others in a step before the engine fails")

    pd = p.add_argument_group("prefill/decode disaggregation (docs/distributed.md)")
    pd.add_argument("--pd-server", action="store_true",
                    help="prefill prompts for a --pd-client (the usual API is served too)")
    pd.add_argument("--pd-client", action="store_true",
                    help="serve the API and decode; prompts are prefilled by the --pd-server at --pd-url")
    pd.add_argument("--pd-url", metavar="URL", help="with --pd-client: the prefill server, e.g. http://10.0.0.2:8000 "
                    "(sent this server's --api-key, which a pair shares)")
    pd.add_argument("--pd-fallback", default="error", choices=["error", "local"],
                    help="with --pd-client, where the prefill server fails: answer the request with 503, or prefill "
                    "it here")
    pd.add_argument("--pd-transport", default="auto", choices=["auto", "gloo", "shm"],
                    help="how caches move from the --pd-server to the --pd-client: shared memory where both run on "
                    "one host, else gloo over TCP (auto); only gloo; only shared memory (set on either side)")
    pd.add_argument("--pd-timeout", type=_at_least(float, 1), default=60.0, metavar="SECONDS",
                    help="seconds a prefill (and its transfer) may take before it fails")

    chat = p.add_argument_group("terminal")
    chat.add_argument("--i", dest="interactive", action="store_true",
                      help="chat in the terminal instead of serving (as xinfer chat; commands: /exit, /clear, "
                      "/system TEXT, /help)")
    chat.add_argument("--prompts", metavar='"A|B"',
                      help="answer these prompts (separated by |), print the answers and the speed, exit")
    chat.add_argument("--batch", type=_at_least(int, 1), metavar="N",
                      help="with --prompts: run N copies of the prompts as one batch (default: 1)")
    # fmt: on

    later = p.add_argument_group(
        "later features (listed as xInfer names them; refused in one line)", argument_default=SUPPRESS
    )
    later.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="N",
        help="speculative decoding: N tokens drafted per step by the model's MTP layers or by --draft-model [later]",
    )
    later.add_argument("--draft-model", metavar="ID_OR_PATH", help="draft model for speculative decoding [later]")
    later.add_argument(
        "--prefix-cache-max-tokens",
        type=int,
        metavar="TOKENS",
        help="bound the prefix cache to this many tokens [later]",
    )
    return p


def parse_args(argv: Sequence[str] | None = None, prog: str = "xinfer", description: str = SERVE) -> argparse.Namespace:
    parser = build_parser(prog, description)
    apply_environment(parser, os.environ)
    args = parser.parse_args(argv)
    refusal = later_feature(args, parser)
    if refusal:
        print(f"{prog}: {refusal} is not available yet in this version of xinfer", file=sys.stderr)
        raise SystemExit(2)
    problem = flags_problem(args)
    if problem:
        print(f"{prog}: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return args


def flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of flags, if anything."""
    return sampling_problem(args) or nodes_problem(args) or pd_problem(args) or terminal_problem(args)


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                  "presence_penalty", "max_tokens")  # fmt: skip


def sampling_problem(args: argparse.Namespace) -> str | None:
    """A sampling default out of the range a request's own value must be in (the same check), or a
    ``--generation-config`` that is no choice and no folder."""
    for name in SAMPLING_FLAGS:
        value = getattr(args, name)
        try:
            if value is not None:
                SamplingParams(**{name: value})
        except ValueError as error:
            return f"--{name.replace('_', '-')} {value}: {error}"
    try:
        check_generation_config(args.generation_config)
    except ValueError as error:
        return f"--{error}".replace("generation_config", "generation-config", 1)
    return None


def terminal_problem(args: argparse.Namespace) -> str | None:
    if args.batch is not None and not args.prompts:
        return "--batch copies the prompts of --prompts: give --prompts too"
    if args.prompts is not None and not split_prompts(args.prompts):
        return "--prompts holds no prompt (prompts are separated by |)"
    return None


def split_prompts(text: str) -> list[str]:
    """The prompts of ``--prompts``: separated by ``|``, blank ones dropped."""
    return [prompt.strip() for prompt in text.split("|") if prompt.strip()]


def nodes_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the multi-node flags, if anything."""
    if args.node_rank >= args.num_nodes:
        return f"--node-rank {args.node_rank} is not one of the {args.num_nodes} nodes (0 to {args.num_nodes - 1})"
    if args.num_nodes > 1 and args.master_port is None:
        return "--num-nodes above 1: give --master-port (and --master-addr, node 0's address) on every node"
    return None


def pd_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the prefill/decode flags, if anything."""
    if args.pd_server and args.pd_client:
        return "--pd-server and --pd-client: a server takes one role"
    if args.pd_client != bool(args.pd_url):
        return "--pd-client needs --pd-url (the prefill server), and --pd-url needs --pd-client"
    if args.pd_transport != "auto" and not (args.pd_server or args.pd_client):
        return "--pd-transport needs --pd-server or --pd-client"
    split = bool(args.devices and len(args.devices) > 1) or args.num_nodes > 1
    if (args.pd_server or args.pd_client) and (args.disable_prefix_cache or split):
        return (
            "--pd-server/--pd-client need the prefix cache and one device (no --disable-prefix-cache, --d with one id)"
        )
    return None


def later_feature(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """The flag of a feature that arrives later, if one is given: those flags have no default (SUPPRESS)."""
    for action in parser._actions:
        if action.default is argparse.SUPPRESS and action.dest in vars(args):
            return f"{action.option_strings[0]} ({(action.help or '').removesuffix(' [later]')})"
    return None


def _json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of fields, got {text!r}")
    return value


def _device_ids(text: str) -> list[int]:
    """An argparse type: ``0`` or ``0,1``, distinct ids."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected device ids such as 0 or 0,1, got {text!r}") from None
    if len(set(ids)) != len(ids) or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected distinct device ids of 0 or more, got {text!r}")
    return ids


def apply_environment(parser: argparse.ArgumentParser, environ: dict[str, str] | os._Environ) -> None:
    """Makes ``XINFER_<FLAG>`` values the defaults, so that flags still win."""
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        for name in (ENV_PREFIX + o.lstrip("-").upper().replace("-", "_") for o in action.option_strings):
            if name in environ:
                parser.set_defaults(**{action.dest: _convert(parser, action, name, environ[name])})
                break


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        word = raw.strip().lower()
        if word not in TRUE | FALSE:
            parser.error(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")
        return word in TRUE
    if action.nargs in ("*", "+"):  # a list: its values separated by spaces or commas
        return [_value(parser, action, name, word) for word in raw.replace(",", " ").split()]
    return _value(parser, action, name, raw)


def _value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, raw: str) -> Any:
    convert = action.type
    try:
        value = convert(raw) if callable(convert) else raw
    except ValueError:
        parser.error(f"{name}={raw!r}: not a valid {getattr(action.type, '__name__', 'value')}")
    except argparse.ArgumentTypeError as error:
        parser.error(f"{name}={raw!r}: {error}")
    if action.choices is not None and value not in action.choices:
        parser.error(f"{name}={raw!r}: choose one of {', '.join(map(str, action.choices))}")
    return value
