"""A prompt's cache moved between two in-process engines of a hybrid model (Gated DeltaNet's
recurrent state and full-attention blocks; the state alone where every layer is a DeltaNet layer), packed into a payload or read from the other engine's
cache mapped through shared memory: the receiving engine, which never computed the prompt, hits it
in its prefix cache and decodes transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.qwen.test_qwen3_next import CONFIGS, deltanet_alone, randomize_hybrid, uncached_greedy
from tests.tiny_models import prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.distributed.kv_transfer import (
    copy_prefix,
    export_prefix,
    held_ids,
    hold_prefix,
    import_prefix,
    layout_signature,
    open_cache,
    rows_of,
    share_cache,
)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["hybrid", "deltanet layers alone"])
def hybrid(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3.5")
    config = CONFIGS["qwen3.5"]()
    if request.param == "deltanet layers alone":  # no block to move: the state alone
        config = deltanet_alone(config)
    hf = save_tiny_model(config, folder)
    randomize_hybrid(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    options = dict(model=str(folder), dtype="float32", num_blocks=64)
    return hf, LLM(**options), LLM(**options)


def test_recurrent_state_and_blocks_move_between_engines(hybrid):
    hf, prefill, decode = hybrid
    tokens = prompt(45, seed=11)
    assert layout_signature(prefill.engine)["states"]  # the model has recurrent state to move
    prefill.generate([tokens], SamplingParams(temperature=0, max_tokens=1))
    num_tokens, payload = export_prefix(prefill.engine, tokens)
    assert (
        num_tokens == 32
        or num_tokens == (len(tokens) - 1) // prefill.engine.cache.block_size * prefill.engine.cache.block_size
    )
    assert import_prefix(decode.engine, tokens, num_tokens, payload)
    got = decode.generate([tokens], GREEDY)[0].outputs[0].token_ids
    assert decode.engine.cache.hits * decode.engine.cache.block_size == num_tokens  # decoded from the moved cache
    assert got == uncached_greedy(hf, tokens, len(got))[0]


def test_a_payload_of_another_layout_is_refused_and_nothing_is_registered(hybrid):
    _, prefill, decode = hybrid
    tokens = prompt(40, seed=12)
    prefill.generate([tokens], SamplingParams(temperature=0, max_tokens=1))
    num_tokens, payload = export_prefix(prefill.engine, tokens)
    hits = decode.engine.cache.hits
    with pytest.raises(ValueError, match="layout differs"):
        import_prefix(decode.engine, tokens, num_tokens, torch.cat([payload, payload[:4]]))
    decode.generate([tokens], GREEDY)
    assert decode.engine.cache.hits == hits


def test_the_held_prefix_is_copied_from_the_shared_cache(hybrid):
    hf, prefill, decode = hybrid
    tokens = prompt(50, seed=13)
    prefill.generate([tokens], SamplingParams(temperature=0, max_tokens=1))
    mapped = open_cache(decode.engine, share_cache(prefill.engine))  # as a process of the same host maps it
    hits, cached = decode.engine.cache.hits, _cached_blocks(decode)
    seq, num_tokens = hold_prefix(prefill.engine, tokens)
    try:
        assert seq.state_slot is not None  # the recurrent state moves too
        sources = rows_of(*mapped, held_ids(prefill.engine, seq))
        with pytest.raises(ValueError, match="no longer held"):  # copied after the prefill engine's lease ended
            copy_prefix(decode.engine, tokens, num_tokens, sources, held_until=0.0)
        assert _cached_blocks(decode) == cached  # nothing was registered
        assert copy_prefix(decode.engine, tokens, num_tokens, sources)
    finally:
        prefill.engine.cache.release(seq)
    got = decode.generate([tokens], GREEDY)[0].outputs[0].token_ids
    assert (decode.engine.cache.hits - hits) * decode.engine.cache.block_size == num_tokens > 0
    assert got == uncached_greedy(hf, tokens, len(got))[0]


def _cached_blocks(llm: LLM) -> int:
    return sum(len(pool.cached) for pool in llm.engine.cache.pools)
