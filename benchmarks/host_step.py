"""Host time of an engine decode step at large batches, the device left out: a tiny
model on the CPU whose step runner is the CUDA backend's (the same bucket choice and
input packing, :class:`xinfer_cuda.static_step.StaticStep`) with the replay replaced by
random tokens. One JSON line per batch size: CPU ms per step (this thread's, so that
other processes' load counts little) by phase: schedule, prepare, load (padding and
packing the inputs), sample (the read-back's copies), read_back, engine_rest (the
engine's own loops: sampled rows' parameters, pending inputs, appending tokens, stop
checks, cache commits), output (the output processor: detokenizing, deltas), total.

python benchmarks/host_step.py --num-seqs 256 512 1024
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch
from offline import time_phases
from shapes import save_synthetic_tokenizer
from transformers import LlamaConfig

from xinfer import LLM, SamplingParams
from xinfer.ops import DeviceTokens, HostBatch, StepLimits
from xinfer.sampling import SampledRow
from xinfer_cuda.static_step import StaticStep, pick_bucket, step_buckets

VOCAB = 32000


class ReplayLeftOut:
    """The CUDA backend's step runner (:class:`xinfer_cuda.graphs.StepGraphs`) on the CPU,
    without graphs: it pads and loads each step into its buffers, then draws random
    tokens instead of replaying a forward."""

    def __init__(self, limits: StepLimits):
        self.step = StaticStep(None, limits, torch.device("cpu"))  # its forward never runs
        self.buckets = step_buckets(limits)
        self.logits = torch.zeros(limits.max_num_seqs, VOCAB)
        self.tokens = torch.zeros(limits.max_num_seqs, dtype=torch.int64)

    def __call__(
        self, batch: HostBatch, pending: DeviceTokens | None = None, sampling: list[SampledRow] = ()
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        bucket = pick_bucket(self.buckets, batch)
        if bucket is None or not self.step.fits(batch):
            return None
        self.step.load(batch, bucket, pending, sampling)
        rows = len(batch.sample_rows)
        self.tokens.random_(VOCAB)
        return self.logits[:rows], self.tokens[:rows]


def measure(num_seqs: int, prompt_len: int, warm_steps: int, steps: int, folder: str) -> dict:
    llm = LLM(model=folder, load_format="dummy", dtype="float32", device="cpu", max_num_seqs=num_seqs,
              max_model_len=2048, max_num_batched_tokens=max(8192, num_seqs))  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner
    max_blocks = -(-engine.max_model_len // engine.config.cache.block_size)
    limits = StepLimits(num_seqs, engine.config.scheduler.max_num_batched_tokens, max_blocks, engine.max_model_len)
    runner.graphs = ReplayLeftOut(limits)
    phases = time_phases(llm, time.thread_time)  # this thread's CPU time: other processes' load left out
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(num_seqs)]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=1500, ignore_eos=True)
    for prompt in prompts:
        llm.processor.add(str(next(llm._ids)), prompt, params)
    for _ in range(warm_steps):  # the prompts' steps, then decode only
        llm.processor.step()
    assert len(engine.scheduler.running) == num_seqs and not engine.scheduler.waiting
    phases.update(dict.fromkeys(phases, 0))
    start = time.thread_time()
    for _ in range(steps):
        llm.processor.step()
    total = time.thread_time() - start
    ms = {name: 1e3 * t / steps for name, t in phases.items() if name != "steps"}
    ms["load"] = ms.pop("forward")
    ms["output"] = 1e3 * total / steps - ms["step"]
    ms["total"] = 1e3 * total / steps
    ms["engine_rest"] = ms["step"] - sum(ms[k] for k in ("schedule", "prepare", "load", "sample", "read_back"))
    del ms["step"]
    return {"num_seqs": num_seqs, "ms_per_step": {k: round(v, 3) for k, v in ms.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="xinfer-host-step-")
    LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=4096, architectures=["LlamaForCausalLM"],
                ).save_pretrained(folder)  # fmt: skip
    save_synthetic_tokenizer(folder, VOCAB)
    for num_seqs in args.num_seqs:
        warm = -(-num_seqs * args.prompt_len // max(8192, num_seqs)) + 3
        print(json.dumps(measure(num_seqs, args.prompt_len, warm, args.steps, folder)), flush=True)


if __name__ == "__main__":
    main()
