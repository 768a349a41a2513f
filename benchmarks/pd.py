"""Prefill/decode disaggregation against one server, on one GPU: what the cache transfer costs.

Runs ``benchmarks/serve.py``'s load (random prompts, fixed output length, greedy) first against one
server, then against a ``--pd-client`` whose prompts a ``--pd-server`` prefills, both processes on
the same GPU (each given ``--pd-kv-fraction`` of its memory), once per ``--pd-transport`` listed
(``auto``: shared memory here, both on one host; ``gloo``: over TCP loopback). Prints, for each
setup, a line naming it, then serve.py's JSON line per level: TTFT, ITL, TPOT and throughput; for a
PD setup, then a line with the transport its client used (as the prefill server's ``/pd/status`` says).

    python benchmarks/pd.py --server-args "--m Qwen/Qwen3-0.6B" --concurrency 16 --input-len 1024 --output-len 128 \
        --pd-transport auto,gloo

On the CPU (a check that it runs, not a measurement):

    python benchmarks/pd.py --server-args "--cpu --max-model-len 256" --single-kv-fraction 0.05 \
        --pd-kv-fraction 0.05 --concurrency 2 --input-len 64 --output-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import SAMPLING, benchmark, launch  # the load generator beside this file


def run(
    label: str, load: argparse.Namespace, processes: list[subprocess.Popen], url: str, prefill_url: str = ""
) -> None:
    print(json.dumps({"setup": label}), flush=True)
    try:
        asyncio.run(benchmark(load, url))
        if prefill_url:
            transports = httpx.get(prefill_url + "/pd/status", timeout=10).json()["clients"]
            print(json.dumps({"setup": label, "transport": ",".join(sorted(set(transports.values())))}), flush=True)
    finally:
        for proc in reversed(processes):
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-args", default="", help="flags of every server (the model, ...)")
    parser.add_argument("--single-kv-fraction", default="0.85", help="--kv-fraction of the one server")
    parser.add_argument("--pd-kv-fraction", default="0.42", help="--kv-fraction of each of the two PD servers")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="16")
    parser.add_argument("--num-prompts", default="64")
    parser.add_argument("--random-ids", type=int, metavar="VOCAB", help="as in serve.py (dummy-weight shapes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pd-transport", default="auto", help="comma-separated --pd-transport values: a PD run each")
    args = parser.parse_args()
    load = argparse.Namespace(
        api_key=None, model=None, input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
        concurrency=args.concurrency, request_rate=float("inf"), fixed_rate=False, warmup=True, seed=args.seed,
        random_ids=args.random_ids, sampling=["greedy"],
    )  # fmt: skip
    assert set(load.sampling) <= set(SAMPLING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the launched servers are stopped too

    one, url = launch(f"{args.server_args} --kv-fraction {args.single_kv_fraction}")
    run("one server", load, [one], url)

    for transport in args.pd_transport.split(","):
        pd_args = f"{args.server_args} --kv-fraction {args.pd_kv_fraction} --pd-transport {transport}"
        prefill, prefill_url = launch(f"{pd_args} --pd-server")
        try:
            decode, url = launch(f"{pd_args} --pd-client --pd-url {prefill_url}")
        except BaseException:
            prefill.kill()
            raise
        label = f"prefill/decode: --pd-server and --pd-client on one GPU, --pd-transport {transport}"
        run(label, load, [prefill, decode], url, prefill_url)


if __name__ == "__main__":
    main()
