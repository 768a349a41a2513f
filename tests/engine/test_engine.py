"""Continuous batching, preemption, prefix caching and bad input on a tiny Llama."""

import asyncio
import itertools
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.engine import sampler
from xinfer.engine.async_engine import AsyncEngine
from xinfer.engine.failures import RequestError
from xinfer.engine.output import OutputProcessor
from xinfer.engine.sampler import SampledTokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=model_dir, dtype="float32", num_blocks=256, max_num_batched_tokens=512)


def assert_all_blocks_free(llm: LLM) -> None:
    assert all(pool.num_free_blocks == pool.num_blocks for pool in llm.engine.cache.pools)
    assert not llm.engine.has_unfinished()


PROMPTS = [prompt(3 + 7 * i, seed=i) for i in range(16)]  # 3 .. 108 tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=24, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_batch_gives_each_prompt_what_it_gets_alone(llm, params):
    together = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert_all_blocks_free(llm)


def test_stats_count_the_steps_their_sequences_and_tokens(llm):
    """A prompt of 21 tokens (no prefix in the cache) and 5 new ones: one step computes the prompt, four
    more each compute the token before; then two prompts at once share their steps."""
    before = llm.engine.stats()
    llm.generate([prompt(21, seed=31)], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    alone = llm.engine.stats()
    assert (alone.num_steps - before.num_steps, alone.num_step_sequences - before.num_step_sequences) == (5, 5)
    assert alone.num_step_tokens - before.num_step_tokens == 21 + 4
    llm.generate(
        [prompt(19, seed=32), prompt(23, seed=32)], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    )
    both = llm.engine.stats()
    assert (both.num_steps - alone.num_steps, both.num_step_sequences - alone.num_step_sequences) == (3, 6)
    assert both.num_step_tokens - alone.num_step_tokens == 19 + 23 + 2 * 2


def test_requests_join_a_running_batch(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS[:4]]
    llm.engine.add_request("early", PROMPTS[0], params)
    llm.engine.step()
    llm.engine.step()  # "early" is decoding when the others arrive
    stream = llm.stream(PROMPTS[1:4], params)
    got = {}
    for delta in stream:
        got.setdefault(delta.prompt_token_ids[0], []).extend(delta.outputs[0].token_ids)
    assert [got[p[0]] for p in PROMPTS[1:4]] == expected[1:4]
    assert_all_blocks_free(llm)


def test_a_lone_arrival_at_a_nearly_full_batch_waits_at_most_a_groups_steps(model_dir):
    """With 15 of 16 slots decoding, one new prompt is not admitted on its own at once (prompts join in groups
    of an eighth of the slots, 2 here) but after two steps' wait, not when two of the 15 have finished."""
    llm = LLM(model=model_dir, dtype="float32", num_blocks=256, max_num_seqs=16)
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(15):
        engine.add_request(f"long{i}", PROMPTS[i % 4], long)
    for _ in range(3):
        engine.step()
    late = engine.add_request("late", PROMPTS[5], long)
    joined = []
    for _ in range(4):
        engine.step()
        joined.append(late.scheduled_once)
    assert joined == [False, False, True, True]
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(llm)


def test_preemption_under_a_tiny_pool_gives_the_same_outputs(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [prompt(30, seed=i) for i in range(8)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    small = LLM(model=model_dir, dtype="float32", num_blocks=8, max_model_len=128, block_size=16)
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    assert got == expected
    assert small.engine.stats().num_preemptions > 0
    assert_all_blocks_free(small)


def test_prefix_cache_reports_cached_tokens_and_keeps_outputs(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = prompt(70, seed=42)
    first, second = shared + prompt(5, seed=1), shared + prompt(9, seed=2)
    llm.generate([first], params)
    cached = llm.generate([second], params)[0]
    assert cached.num_cached_tokens == 64  # the four full 16-token blocks of the shared prefix
    uncached_llm = LLM(model=model_dir, dtype="float32", num_blocks=64, enable_prefix_caching=False)
    uncached = uncached_llm.generate([second], params)[0]
    assert uncached.num_cached_tokens == 0
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_chunked_prefill_gives_the_same_tokens(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    long_prompt = prompt(200, seed=3)
    chunked = LLM(model=model_dir, dtype="float32", num_blocks=64, max_num_batched_tokens=48)
    assert chunked.generate([long_prompt], params)[0].outputs[0].token_ids == (
        llm.generate([long_prompt], params)[0].outputs[0].token_ids
    )


def test_sampling_controls(llm):
    tokens = prompt(20, seed=5)
    greedy = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    first = greedy.outputs[0].token_ids[0]
    stopped = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"
    held = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3))[0]
    assert len(held.outputs[0].token_ids) >= 3 and held.outputs[0].token_ids[0] != first
    with_logprobs = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=2, logprobs=3))[0]
    step = with_logprobs.outputs[0].logprobs[0]
    assert first in step and len(step) == 3 and max(step, key=step.get) == first
    top1 = llm.generate([tokens], SamplingParams(temperature=5.0, top_k=1, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert top1.outputs[0].token_ids == greedy.outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, n=2)
    a, b = llm.generate([tokens], seeded)[0], llm.generate([tokens], seeded)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    penalized = llm.generate(
        [tokens],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0),
    )[0]
    plain = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert len(set(penalized.outputs[0].token_ids)) >= len(set(plain.outputs[0].token_ids))
    forced = llm.generate([tokens], SamplingParams(temperature=1.0, seed=2, max_tokens=4, logit_bias={7: 100.0}))[0]
    assert forced.outputs[0].token_ids == [7] * 4
    banned = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100.0}))[0]
    assert banned.outputs[0].token_ids[0] != first
    assert_all_blocks_free(llm)


def test_the_host_reads_a_step_back_after_launching_the_next(llm, monkeypatch):
    events, launched = [], []
    launch = llm.engine.runner.step

    def launching(scheduled, previous=None, before_sampling=None):
        sampled = launch(scheduled, previous, before_sampling)
        launched.append(sampled)  # alive to the end, so that no later step's tokens reuse its id
        events.append(("launch", id(sampled)))
        return sampled

    read = SampledTokens.result
    monkeypatch.setattr(llm.engine.runner, "step", launching)
    monkeypatch.setattr(SampledTokens, "result", lambda self: events.append(("read", id(self))) or read(self))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([PROMPTS[3]], params)[0].outputs[0].token_ids
    events.clear()
    assert llm.generate([PROMPTS[3]], params)[0].outputs[0].token_ids == alone
    launches = [key for kind, key in events if kind == "launch"]
    assert len(launches) == 6
    for step, following in itertools.pairwise(launches):
        assert events.index(("launch", following)) < events.index(("read", step))


def test_steps_put_the_longest_context_first(llm, monkeypatch):
    batches = []
    prepare = llm.engine.runner.prepare
    monkeypatch.setattr(
        llm.engine.runner, "prepare", lambda scheduled: batches.append(prepare(scheduled)) or batches[-1]
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(PROMPTS[::-1], params)  # shortest prompt last in, longest first
    llm.generate(PROMPTS, params)  # and the other way round
    assert any(len(b.seq_lens) > 1 for b in batches)
    for batch in batches:
        assert batch.seq_lens == sorted(batch.seq_lens, reverse=True)


def test_stop_abort_and_context_limit_while_a_step_is_in_flight(model_dir):
    llm = LLM(model=model_dir, dtype="float32", num_blocks=64, max_model_len=40)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    b_alone = llm.generate([PROMPTS[2]], greedy)[0].outputs[0].token_ids
    third = b_alone[2]
    engine.add_request("a", PROMPTS[1], greedy)
    b = engine.add_request("b", PROMPTS[2], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[third]))
    c = engine.add_request("c", PROMPTS[4], SamplingParams(temperature=0, ignore_eos=True))  # 31 tokens: 9 fit
    outputs = engine.step()  # launched the prompts; nothing read back yet
    assert outputs == []
    engine.abort("a")
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    assert "a" not in got
    assert [o.token_ids[0] for o in got["b"]] == b_alone[:3] and got["b"][-1].finish_reason == "stop"
    assert len(got["c"]) == 40 - len(PROMPTS[4]) and got["c"][-1].finish_reason == "length"
    assert [o.finished for o in got["c"]] == [False] * (len(got["c"]) - 1) + [True]
    for seq, name in ((b, "b"), (c, "c")):  # no token left pending on a finished sequence
        assert seq.output_token_ids == [o.token_ids[0] for o in got[name]]
    assert_all_blocks_free(llm)


# ---- a request's own failure ends it alone ------------------------------------------------

FAULTY = 5  # the index in PROMPTS[:8] of the request a fault is injected into


class InjectedFault(Exception):
    pass


def faulty(seq, after: int) -> bool:
    return seq.prompt_token_ids == PROMPTS[FAULTY] and seq.num_output_tokens >= after


def inject_fault(llm: LLM, monkeypatch, where: str, after: int) -> None:
    """Makes the work ``where`` raise for the request of ``PROMPTS[FAULTY]`` once it has ``after`` tokens."""
    engine = llm.engine
    if where == "packing":  # the cache slot of one of its tokens
        slot = engine.runner.slot

        def packing(table, position):
            if any(faulty(seq, after) and seq.pages[0].blocks is table for seq in engine.scheduler.running):
                raise InjectedFault("packing")
            return slot(table, position)

        monkeypatch.setattr(engine.runner, "slot", packing)
    elif where == "sampling":  # the faulty request's logit_bias makes the batch's draw adjust logits
        bias = sampler.apply_logit_bias

        def biasing(logits, seqs):
            if any(faulty(seq, after) for seq in seqs):
                raise InjectedFault("sampling")
            return bias(logits, seqs)

        monkeypatch.setattr(sampler, "apply_logit_bias", biasing)
    elif where == "reading back":
        finish_reason = engine._finish_reason

        def reading(seq, token):
            if faulty(seq, after):
                raise InjectedFault("reading back")
            return finish_reason(seq, token)

        monkeypatch.setattr(engine, "_finish_reason", reading)
    else:
        text = OutputProcessor._text

        class FailingText:
            def __init__(self, stream):
                self.stream, self.num_tokens = stream, 0

            def push(self, token_ids, stop_token=False):
                self.num_tokens += len(token_ids)
                if self.num_tokens > after:
                    raise InjectedFault("detokenizing")
                return self.stream.push(token_ids, stop_token)

            def finish(self):
                return self.stream.finish()

        def texts(self, params, prompt_token_ids):
            stream = text(self, params, prompt_token_ids)
            return FailingText(stream) if prompt_token_ids == PROMPTS[FAULTY] else stream

        monkeypatch.setattr(OutputProcessor, "_text", texts)


@pytest.mark.parametrize("after", [0, 3], ids=["in-prefill", "mid-decode"])
@pytest.mark.parametrize("where", ["packing", "sampling", "reading back", "detokenizing"])
def test_a_request_whose_work_fails_ends_alone_and_the_others_get_their_tokens(llm, monkeypatch, where, after):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = [greedy] * 8
    params[FAULTY] = replace(greedy, logit_bias={0: 0.0})
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], params)]
    inject_fault(llm, monkeypatch, where, after)
    got = [o.outputs[0] for o in llm.generate(PROMPTS[:8], params)]
    failed = got.pop(FAULTY)
    assert failed.finish_reason == "error"
    assert failed.error == f"InjectedFault: {where}"
    assert len(failed.token_ids) <= after + 2  # at most a step launched before the failure was found
    assert [o.token_ids for o in got] == expected[:FAULTY] + expected[FAULTY + 1 :]
    assert all(o.finish_reason == "length" for o in got)
    assert not llm.engine.sequences and not llm.processor._choices
    assert_all_blocks_free(llm)


def failing_where_biased(monkeypatch) -> None:
    """Makes the draw of every row whose request has a ``logit_bias`` raise, as a request's own parameters may."""
    bias = sampler.apply_logit_bias

    def biasing(logits, seqs):
        if any(seq.params.logit_bias for seq in seqs):
            raise InjectedFault("sampling")
        return bias(logits, seqs)

    monkeypatch.setattr(sampler, "apply_logit_bias", biasing)


def test_a_step_whose_every_draw_fails_ends_those_requests_alone_and_the_engine_serves_on(llm, monkeypatch):
    """Every row of a step failing, each alone, is not the batch's failure where the sample op draws from the same
    logits (it stopped the engine): each request ends with its own error, and the next request gets its tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    failing_where_biased(monkeypatch)
    failed = [o.outputs[0] for o in llm.generate(PROMPTS[:4], replace(greedy, logit_bias={0: 0.0}))]
    assert [(o.finish_reason, o.error, o.token_ids) for o in failed] == [("error", "InjectedFault: sampling", [])] * 4
    assert_all_blocks_free(llm)
    assert llm.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids == expected


def test_the_async_engine_serves_on_after_a_step_whose_every_draw_failed(llm, monkeypatch):
    """The server's engine loop: a request whose every choice's draw fails raises RequestError on its stream, and
    the loop goes on to answer the next request (it died, and every later request got EngineUnavailable)."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([PROMPTS[0]], greedy)[0].outputs[0].token_ids
    failing_where_biased(monkeypatch)

    async def serve():
        engine = AsyncEngine(lambda: llm.engine)
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            failing = await engine.submit([(p, replace(greedy, logit_bias={0: 0.0}, n=2)) for p in PROMPTS[:3]])
            with pytest.raises(RequestError, match="InjectedFault: sampling"):
                await engine.collect(failing)
            later = await engine.collect(await engine.submit([(PROMPTS[0], greedy)]))
            return later[0].token_ids, engine.health()
        finally:
            engine.stop(timeout=5)

    assert asyncio.run(asyncio.wait_for(serve(), 60)) == (expected, (True, "ready"))
    assert_all_blocks_free(llm)


def test_prompt_logprobs_and_embeddings_wait_for_the_blocks_the_running_batch_holds(model_dir):
    """A request's whole-prompt forward (prompt logprobs, embeddings) borrows blocks between steps: with the running
    batch holding them it was refused ("the KV cache is full; retry later": a 503) where a plain request queues.
    Now it waits, in order with later requests, for the blocks the running sequences free; an add its client
    aborted while it waited never happens."""
    small = LLM(model=model_dir, dtype="float32", num_blocks=8, max_model_len=128, max_num_batched_tokens=64)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    scored = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    question = prompt(40, seed=5)
    expected = small.generate([question], scored)[0]
    expected_hidden = small.engine.hidden_states(question)

    async def serve():
        engine = AsyncEngine(lambda: small.engine)
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            busy = await engine.submit([(prompt(40, seed=90 + i), long) for i in range(2)])
            while engine.stats.num_running < 2:  # the two hold 6 of the 8 blocks, and grow
                await asyncio.sleep(0.01)
            waiting = asyncio.create_task(engine.submit([(question, scored)]))
            embedding = asyncio.create_task(engine.embed([question]))
            gone = asyncio.create_task(engine.submit([(question, scored)]))
            await asyncio.sleep(0.05)
            gone.cancel()  # its client left while it waited
            handle = await waiting
            answer = await engine.collect(handle)
            await engine.collect(busy)
            return handle.outputs[0].prompt_logprobs, answer[0].token_ids, (await embedding)[0]
        finally:
            engine.stop(timeout=5)

    prompt_logprobs, token_ids, hidden = asyncio.run(asyncio.wait_for(serve(), 120))
    assert token_ids == expected.outputs[0].token_ids
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(expected.prompt_logprobs)
    for got, alone in zip(prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert {t: v.logprob for t, v in got.items()} == pytest.approx({t: v.logprob for t, v in alone.items()})
    assert torch.allclose(hidden, expected_hidden.float(), atol=1e-5)
    assert_all_blocks_free(small)


@pytest.mark.parametrize("num_prompts", [1, 4])
@pytest.mark.parametrize("where", ["forward", "sampling"])
def test_a_failure_of_the_whole_step_raises_and_frees_every_request(llm, monkeypatch, where, num_prompts):
    """Not a request's own failure (the forward of the batch, a draw that fails for every row): ``generate``
    raises it, no hang."""

    def failing(*args, **kwargs):
        raise RuntimeError("the device is lost")

    if where == "forward":
        monkeypatch.setattr(llm.engine.runner, "eager_forward", failing)
    else:
        monkeypatch.setattr(sampler.ops, "sample", failing)
    with pytest.raises(RuntimeError, match="the device is lost"):
        llm.generate(PROMPTS[:num_prompts], SamplingParams(temperature=0, max_tokens=4))
    assert_all_blocks_free(llm)


def test_more_choices_than_max_num_seqs_run_in_turns(model_dir):
    """A request's ``n`` above ``max_num_seqs`` is no hang: its choices wait and run in turns, each the tokens it
    draws alone (its seed plus its index)."""
    llm = LLM(model=model_dir, dtype="float32", num_blocks=64, max_num_seqs=2)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, n=5)
    choices = llm.generate([PROMPTS[2]], params)[0].outputs
    alone = [llm.generate([PROMPTS[2]], replace(params, n=1, seed=3 + i))[0].outputs[0] for i in range(5)]
    assert [c.token_ids for c in choices] == [a.token_ids for a in alone]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in choices)
    assert_all_blocks_free(llm)


class LetterTokenizer:
    """Token ``i`` reads as one letter, so a two-letter stop string always spans two tokens."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_strings_across_tokens_and_n_seeded_choices(model_dir):
    llm = LLM(model=model_dir, tokenizer=LetterTokenizer(), dtype="float32", num_blocks=64)
    tokens = prompt(20, seed=6)
    free = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert free.text == LetterTokenizer().decode(free.token_ids)
    stop = free.text[5:7]
    cut = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    end = free.text.index(stop)
    assert cut.outputs[0].text == free.text[:end] and cut.outputs[0].token_ids == free.token_ids[: end + 2]
    assert (cut.outputs[0].finish_reason, cut.outputs[0].stop_reason) == ("stop", stop)
    kept = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    with_stop = llm.generate([tokens], kept)[0].outputs[0]  # vLLM's option: the text ends after the stop string
    assert with_stop.text == free.text[: end + 2] and with_stop.token_ids == cut.outputs[0].token_ids
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, n=3)
    choices = llm.generate([tokens], seeded)[0].outputs
    for i, choice in enumerate(choices):  # choice i samples as a request of its own with seed + i
        alone = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True)
        assert choice.index == i and choice.token_ids == llm.generate([tokens], alone)[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_stop_strings_count_after_min_tokens(model_dir):
    """vLLM's ``min_tokens``: a stop string ending in the text of the first ``min_tokens`` tokens does not stop
    the sequence (vLLM's tests/detokenizer/test_min_tokens.py); the next one after them does."""
    llm = LLM(model=model_dir, tokenizer=LetterTokenizer(), dtype="float32", num_blocks=64)
    tokens = prompt(20, seed=6)
    free = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].text
    stop = next(letter for letter in free if free.count(letter) > 1)  # one letter: one token
    first, second = free.index(stop), free.index(stop, free.index(stop) + 1)
    held = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=first + 1)
    out = llm.generate([tokens], held)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (free[:second], "stop", stop)
    two_letters = free[first : first + 2]  # ends in the token after the first min_tokens: it stops there
    out = llm.generate([tokens], replace(held, stop=[two_letters]))[0].outputs[0]
    assert out.text == free[:first]


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([[]], SamplingParams(), "prompt is empty"),
        ([list(range(1, 300)) * 2], SamplingParams(), "598 tokens"),
        ([[1, 2, 3]], dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
        ([[1, 2, 3]], dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
        ([[1, 2, 3]], dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        ([[1, 2, 3]], dict(temperature=-0.5), "temperature must be >= 0, got -0.5"),
        ([[1, 2, 99999]], SamplingParams(), "[0, 320)"),
        ([[-1, 2]], SamplingParams(), "[0, 320)"),
        ([[1, 2.5]], SamplingParams(), "token ids are integers, got list [1, 2.5]"),
        ([None], SamplingParams(), "a prompt is a string, a list of token ids, or a dict"),
        ([{"text": "hi"}], SamplingParams(), "a prompt dict holds 'prompt' (a string) or 'prompt_token_ids'"),
        ([{"prompt_token_ids": [1, 320]}], SamplingParams(), "[0, 320)"),
        ([[1, 2, 3]], dict(top_k=-2), "top_k must be -1, 0 (off) or positive, got -2"),
        ([[1, 2, 3]], dict(top_k=2**63), "top_k must be below 2**63"),
        ([[1, 2, 3]], dict(n=0), "n must be at least 1, got 0"),
        ([[1, 2, 3]], dict(stop=5), "stop must be a string or a list of strings, got 5"),
        ([[1, 2, 3]], dict(stop=[5]), "stop must be a string or a list of strings, got [5]"),
        ([[1, 2, 3]], dict(stop_token_ids="2"), "stop_token_ids must be a list of token ids"),
        ([[1, 2, 3]], dict(max_tokens=2.5), "max_tokens must be an integer or None, got float 2.5"),
        ([[1, 2, 3]], dict(temperature="0"), "temperature must be a number, got str '0'"),
    ],
)
def test_bad_requests_raise_clear_errors_and_leave_no_blocks(llm, prompts, params, message):
    with pytest.raises(ValueError) as error:
        sampling = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        llm.generate([[5, 6, 7]] + prompts, sampling)  # the good first prompt must be undone too
    assert message in str(error.value)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        (None, None, "prompts: a string, a list of token ids, or a dict"),
        (7, None, "prompts: a string, a list of token ids, or a dict"),
        ([[1, 2]], {"max_tokens": 2}, "sampling_params: a SamplingParams or a list of them, got dict"),
        ([[1, 2], [3]], [SamplingParams()], "2 prompts but 1 sampling params"),
    ],
)
def test_prompts_and_params_of_the_wrong_kind_raise_value_errors(llm, prompts, params, message):
    """vLLM's users pass these by mistake: a ValueError naming what was given (a TypeError too), not an
    iteration error from inside the engine."""
    with pytest.raises(ValueError) as error:
        llm.generate(prompts, params)
    assert message in str(error.value)
    assert isinstance(error.value, TypeError) == (
        "but" not in message
    )  # a count is no type    assert_all_blocks_free(llm)


def test_no_prompts_give_no_outputs(llm):
    assert llm.generate([]) == []


@pytest.mark.parametrize("messages", [None, "Hi", [{"role": "user", "content": "Hi"}, "Hi"], [[{"role": "user"}], 3]])
def test_chat_messages_of_the_wrong_kind_raise_value_errors(llm, messages):
    with pytest.raises(ValueError, match=r"^messages: a list of message dicts \(\{'role': \.\.\., 'content'"):
        llm.chat(messages)
