"""Two processes as two "nodes" on 127.0.0.1 (``--num-nodes 2 --node-rank k --master-addr 127.0.0.1``):
node 0 is this process's engine, node 1 ``xinfer``'s command; they give one process's tokens, and
node 1 exits 0 when node 0's engine shuts down."""

from __future__ import annotations

import subprocess
import sys

from transformers import Qwen3Config

from tests.plugins.hf_parity import randomize
from tests.server.live import REPO, free_port
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)


def test_two_nodes_give_one_process_tokens(tmp_path):
    hf = save_tiny_model(Qwen3Config(**COMMON, head_dim=32, architectures=["Qwen3ForCausalLM"]), tmp_path)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    prompts = [prompt(6), prompt(19, seed=1)]
    options = dict(model=str(tmp_path), dtype="float32", num_blocks=64)
    expected = LLM(**options).generate(prompts, GREEDY)
    port = str(free_port())
    node_1 = subprocess.Popen(
        [sys.executable, "-m", "xinfer.cli", "--m", str(tmp_path), "--cpu", "--dtype", "f32", "--d", "0",
         "--num-nodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", port],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        with LLM(**options, device="cpu", tensor_parallel_size=2, num_nodes=2, node_rank=0,
                 master_addr="127.0.0.1", master_port=int(port)) as llm:  # fmt: skip
            got = llm.generate(prompts, GREEDY)
        assert node_1.wait(60) == 0, node_1.stdout.read() if node_1.stdout else ""
    finally:
        node_1.kill()
    for a, b in zip(expected, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs is not None and a.outputs[0].logprobs is not None
        for x, y, token in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(x[token] - y[token]) <= 1e-4
