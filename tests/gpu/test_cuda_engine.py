"""End to end on the GPU: the cuda backend (Triton kernels, CUDA graphs) gives the
CPU backend's tokens. Runs on the GPU machine (benchmarks/gpu_suite.py)."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

from tests.plugins.gemma.test_gemma4 import E_MODEL, MOE, gemma4_config, randomize_gemma4
from tests.plugins.hf_parity import spread_routing
from tests.plugins.qwen.test_qwen3_next import CONFIGS as HYBRID_CONFIGS
from tests.plugins.qwen.test_qwen3_next import randomize_hybrid
from tests.tiny_models import COMMON, gemma3_config, phi3_longrope_config, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer_cuda.linear import DOT_TILES, ONE_PASS_TILES, ONE_ROW_TILES, SmallBatchLinear
from xinfer_cuda.moe_tiles import SmallBatchMoE
from xinfer_cuda.ops import CudaOps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)

# Wider weights than the default 0.02 spread the logits of a random model, so that the
# CPU's and the GPU's summation orders (1e-6 apart) do not flip a near-tie.
WIDE = {**COMMON, "initializer_range": 0.2}
CONFIGS = {
    "llama": lambda: LlamaConfig(**WIDE, architectures=["LlamaForCausalLM"]),
    "qwen3-window": lambda: Qwen3Config(
        **WIDE,
        head_dim=64,
        use_sliding_window=True,  # without it transformers' config drops the window, and sliding layers fail
        sliding_window=24,
        layer_types=["sliding_attention", "full_attention"],
        architectures=["Qwen3ForCausalLM"],
    ),
    # LongRoPE trained at 32 positions: the prompts below start short or long, and 64 new tokens cross over
    "phi3-longrope": lambda: phi3_longrope_config(initializer_range=0.2),
}
PROMPTS = [prompt(n, seed=n) for n in (1, 5, 17, 40, 63, 100)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(CONFIGS[request.param](), folder)
    return str(folder)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_greedy_tokens_equal_cpu_backend(model_dir, enforce_eager):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(
        model=model_dir, dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8, enforce_eager=enforce_eager
    )
    assert tokens(gpu, PROMPTS, params) == tokens(cpu, PROMPTS, params)


@pytest.mark.parametrize(
    "softcaps", [{}, dict(attn_logit_softcapping=20.0, final_logit_softcapping=5.0)], ids=["gemma3", "gemma3-softcaps"]
)
def test_gemma3_gives_cpu_tokens(softcaps, tmp_path):
    # q/k norms inside the rotary kernel, head dim 32, sliding and full layers; the
    # soft-capped LM head returns fp32 logits, the plain one the model dtype
    save_tiny_model(gemma3_config(initializer_range=0.2, **softcaps), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=str(tmp_path), dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8)
    assert tokens(gpu, PROMPTS, params) == tokens(cpu, PROMPTS, params)


# Gemma 4: sliding and global layers with their own head dims (16, 32) and KV heads (2, 1), the global
# layers' values from their keys and their own (proportional) rope; the E-model adds per-layer inputs and
# layers reading earlier layers' caches, the MoE experts beside the dense MLP
GEMMA4 = {"dense": {}, "e-model": E_MODEL, "moe": MOE}


@pytest.fixture(scope="module", params=sorted(GEMMA4))
def gemma4_dir(request, tmp_path_factory) -> str:
    """The tiny Gemma 4 of each variant, wide weights, its norms, layer scalars and router randomized."""
    folder = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    hf = save_tiny_model(gemma4_config(**GEMMA4[request.param], initializer_range=0.2), folder)
    randomize_gemma4(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return str(folder)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gemma4_gives_cpu_tokens(gemma4_dir, enforce_eager):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=gemma4_dir, dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=gemma4_dir, dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager)  # fmt: skip
    assert tokens(gpu, PROMPTS, params) == tokens(cpu, PROMPTS, params)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gemma4_prefix_hit_and_prompt_logprobs_match_cpu_backend(gemma4_dir, enforce_eager):
    """A second call whose prompts share 50 and 40 tokens with the first's hits the prefix cache (steps of
    32 tokens over cached context in both kinds of layer); its tokens are the CPU backend's, and so are its
    prompt log-probabilities and each position's likeliest token, within 1e-4 of their size or 5e-4 (fp32 both,
    summed in other orders: with weights of std 0.2 and logits up to the softcap, 30, rounding reaches ~1.5e-5 of a
    log-probability, 1.1e-4 at -7.9 on the H200, 2.5e-4 at -2.22 for the E-model on the H100; a wrong cache read or
    window moves them by tenths)."""
    shared = prompt(50, seed=7)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    second = [shared + prompt(9, seed=9), shared[:40] + prompt(5, seed=10)]
    runs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=gemma4_dir, dtype="float32", device=device, num_blocks=64, max_num_seqs=8,
                  max_num_batched_tokens=32, enforce_eager=enforce_eager)  # fmt: skip
        llm.generate([shared + prompt(6, seed=8)], params)
        runs[device] = llm.generate(second, params)
        assert runs[device][0].num_cached_tokens == 48
    for cpu, gpu in zip(runs["cpu"], runs["cuda"], strict=True):
        assert gpu.outputs[0].token_ids == cpu.outputs[0].token_ids
        assert gpu.prompt_logprobs is not None and cpu.prompt_logprobs is not None
        assert len(gpu.prompt_logprobs) == len(cpu.prompt_logprobs) == len(gpu.prompt_token_ids)
        for on_gpu, on_cpu in zip(gpu.prompt_logprobs[1:], cpu.prompt_logprobs[1:], strict=True):
            assert on_gpu.keys() == on_cpu.keys()
            assert on_gpu == pytest.approx(on_cpu, rel=1e-4, abs=5e-4)


def test_gpu_batch_invariance(model_dir):
    gpu = LLM(model=model_dir, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=16)
    many = [prompt(3 + 7 * i, seed=i) for i in range(16)]
    for params in (
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    ):
        together = tokens(gpu, many, params)
        alone = [tokens(gpu, [p], params)[0] for p in many]
        assert together == alone


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "turbo4", "turbo3"])
def test_quantized_cache_with_graphs_and_prefix_cache(model_dir, kv_cache_dtype):
    """A quantized cache under CUDA graphs gives the eager steps' tokens, and prompts
    served again from the prefix cache (blocks written in that format) give the same."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        llm = LLM(model=model_dir, dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8,
                  enforce_eager=eager, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        first = tokens(llm, PROMPTS, params)
        assert tokens(llm, PROMPTS, params) == first  # second time through the prefix cache
        assert llm.engine.stats().prefix_cache_hits > 0
        runs[eager] = first
    assert runs[False] == runs[True]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "turbo3"])
def test_recent_window_with_graphs(model_dir, kv_cache_dtype):
    """With a recent window the step graphs give the eager steps' tokens, and a window
    over the whole context gives the unquantized cache's tokens (every key exact)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    options = dict(dtype="float32", device="cuda", num_blocks=256, max_num_seqs=8, enable_prefix_caching=False)

    def run(**cache):
        return {eager: tokens(LLM(model=model_dir, enforce_eager=eager, **options, **cache), PROMPTS, params)
                for eager in (False, True)}  # fmt: skip

    windowed = run(kv_cache_dtype=kv_cache_dtype, kv_recent_window=16)
    assert windowed[False] == windowed[True]
    whole = run(kv_cache_dtype=kv_cache_dtype, kv_recent_window=512)
    assert whole[False] == whole[True] == run()[False]


def staggered_tokens(llm, params) -> dict[str, list[int]]:
    """Prompts arriving while others decode: steps mixing decodes with new prompts'
    chunks (the 250-token prompt spans several steps of a 128-token budget)."""
    engine, out = llm.engine, {}

    def run(num_steps):
        for _ in range(num_steps):
            for delta in engine.step():
                out.setdefault(delta.request_id, []).extend(delta.token_ids)

    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(f"early-{i}", p, params)
    run(3)
    for i, p in enumerate(PROMPTS[2:] + [prompt(250, seed=3)]):
        engine.add_request(f"late-{i}", p, params)
        run(i % 2)
    while engine.has_unfinished():
        run(1)
    return out


def count_replays(runner) -> list[tuple[bool, bool]]:
    """(decode step, replayed) for each step the graphs are asked to run."""
    graphs, seen = runner.graphs, []

    def replay(batch, pending=None, sampling=()):
        stepped = graphs(batch, pending, sampling)
        seen.append((batch.is_decode, stepped is not None))
        return stepped

    runner.graphs = replay
    return seen


def test_mixed_steps_under_graphs_give_eager_and_cpu_tokens(model_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    limits = dict(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=128)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", **limits)
    eager = LLM(model=model_dir, dtype="float32", device="cuda", enforce_eager=True, **limits)
    graphs = LLM(model=model_dir, dtype="float32", device="cuda", **limits)
    replays = count_replays(graphs.engine.runner)
    expected = staggered_tokens(cpu, params)
    assert staggered_tokens(eager, params) == expected
    assert staggered_tokens(graphs, params) == expected
    assert all(replayed for _, replayed in replays)
    assert {decode for decode, _ in replays} == {True, False}


class OurKernels(SmallBatchLinear):
    """Picks, without measuring, a one-row GEMV tile (unrolled) for one row and a dot
    tile for more."""

    def fastest(self, key, weight, baseline, tile_call, tiles):
        rows = {"route": 1, "norm": key[1]}.get(key[0], key[0])  # (keys of the routed and norm-fused linears)
        return ONE_ROW_TILES[7] if rows == 1 else DOT_TILES[2]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_small_batch_linears_in_our_kernels_give_cpu_tokens(model_dir, enforce_eager, monkeypatch):
    """Whatever the measurement picks, the tokens stay the CPU backend's: here every
    linear of up to 16 rows (decode steps, the LM head) runs in our kernels."""
    monkeypatch.setattr(CudaOps, "small_batch_linear", OurKernels())
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=model_dir, dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager)  # fmt: skip
    for prompts in (PROMPTS, PROMPTS[3:4]):  # decode steps of six sequences, then of one
        assert tokens(gpu, prompts, params) == tokens(cpu, prompts, params)
    assert set(CudaOps.small_batch_linear.choice.values()) == {ONE_ROW_TILES[7], DOT_TILES[2]}


class OnePassNormsFusedExperts(OurKernels):
    """:class:`OurKernels`, but one-row norm-fused linears (the routers' too) in a one-pass tile."""

    def fastest(self, key, weight, baseline, tile_call, tiles):
        if key[0] == "route" or (key[0] == "norm" and key[1] == 1):
            return ONE_PASS_TILES[1]
        return super().fastest(key, weight, baseline, tile_call, tiles)


class FusedExperts(SmallBatchMoE):
    """Picks, without measuring, the first candidate that runs gate/up and down in one launch."""

    def fastest(self, x, w13, w2, top_k, activation, default, candidates):
        return next(tiles for tiles in candidates if tiles.fused)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_moe_decode_in_one_pass_norms_and_fused_experts_gives_cpu_tokens(tmp_path, enforce_eager, monkeypatch):
    """Qwen3-MoE decode steps with every norm in a one-pass GEMV tile, the router's with the
    routing, and the experts in one launch (atomics into the token's sums): the CPU backend's
    tokens, and those paths taken."""
    monkeypatch.setattr(CudaOps, "small_batch_linear", OnePassNormsFusedExperts())
    monkeypatch.setattr(CudaOps, "small_batch_moe", FusedExperts())
    config = Qwen3MoeConfig(**WIDE, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48,
                            norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
    save_tiny_model(config, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=str(tmp_path), dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager)  # fmt: skip
    for prompts in (PROMPTS[:4], PROMPTS[3:4]):  # decode steps of four sequences (16 slots), then of one
        assert tokens(gpu, prompts, params) == tokens(cpu, prompts, params)
    assert ONE_PASS_TILES[1] in CudaOps.small_batch_linear.choice.values()
    assert {tiles.fused for tiles in CudaOps.small_batch_moe.choice.values()} == {True}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", ["qwen3.5-moe", "qwen3-next"])
def test_hybrid_decode_gives_cpu_tokens(name, tmp_path, enforce_eager):
    """Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet and gated full-attention layers, a gated shared
    expert): the decode kernels (the gates in the recurrent kernel, the gated norm, the attention's
    output gate read in place, the shared expert's gate and sum in one launch) give the CPU backend's
    tokens, replayed from CUDA graphs and eagerly; prompts longer than a prefill chunk too."""
    hf = save_tiny_model(HYBRID_CONFIGS[name](), tmp_path)
    randomize_hybrid(hf)
    spread_routing(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    limits = dict(dtype="float32", num_blocks=128, max_num_batched_tokens=64)
    cpu = LLM(model=str(tmp_path), device="cpu", **limits)
    gpu = LLM(model=str(tmp_path), device="cuda", max_num_seqs=8, enforce_eager=enforce_eager, **limits)
    for prompts in (PROMPTS[:4], PROMPTS[5:6]):  # decode steps of four sequences, then one after a chunked prompt
        assert tokens(gpu, prompts, params) == tokens(cpu, prompts, params)


def byte_level_tokenizer(folder, vocab_size: int) -> int:
    """A byte-level BPE of ``vocab_size`` tokens trained on a few sentences, ``<|end|>`` its
    id 0 (the model's EOS), saved in ``folder``; returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(['{"name": "sea", "depth": 12}', "the sea is deep and blue"] * 8, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|end|>"}')
    return tokenizer.token_to_id("<|end|>")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_constrained_tokens_equal_cpu_backend(tmp_path, enforce_eager):
    """Grammar masks on the device (the Triton op, pinned bitmask copies, the draw outside
    the step graph) give the CPU backend's tokens; unconstrained rows in the batch too."""
    eos = byte_level_tokenizer(tmp_path, COMMON["vocab_size"])
    save_tiny_model(LlamaConfig(**{**WIDE, "eos_token_id": eos}, architectures=["LlamaForCausalLM"]), tmp_path)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    params = [
        SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": schema}),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=24, structured_outputs={"regex": "[a-z ]{4,30}"}),
        SamplingParams(temperature=0.8, seed=6, max_tokens=24, ignore_eos=True),
    ]
    prompts = PROMPTS[:4]
    cpu = LLM(model=str(tmp_path), dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(model=str(tmp_path), dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager)  # fmt: skip
    assert tokens(gpu, prompts, params) == tokens(cpu, prompts, params)
