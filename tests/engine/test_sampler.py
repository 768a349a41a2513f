"""The sampler over logits in the model dtype: a batch of plain greedy rows picks
from them as they are; anything that computes on them does so in fp32."""

import torch

from xinfer import SamplingParams, ops
from xinfer.engine.sampler import Sampler, SamplerOutput
from xinfer.engine.sequence import Sequence
from xinfer.torch_ops import TorchOps

CPU = torch.device("cpu")


def bf16_logits(rows: int, vocab: int = 500) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, vocab, generator=generator) * 4).to(torch.bfloat16)


def seqs(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(f"s{i}", [1, 2, 3], p, num_prompt_tokens=3) for i, p in enumerate(params)]


def sample(logits: torch.Tensor, batch: list[Sequence]) -> SamplerOutput:
    with ops.use(TorchOps()):
        return Sampler(CPU)(logits, batch).result()


def test_greedy_rows_pick_the_argmax_of_model_dtype_logits():
    logits = bf16_logits(6)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins, as over fp32
    picks = sample(logits.clone(), seqs(*[SamplingParams(temperature=0)] * 6)).token_ids
    assert picks == logits.float().argmax(-1).tolist()
    assert picks[2] == 7


def test_logprobs_and_penalties_are_computed_in_fp32():
    logits = bf16_logits(2)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, repetition_penalty=1.3)]
    out = sample(logits.clone(), seqs(*params))
    reference = logits.float().log_softmax(-1)
    chosen = out.token_ids[0]
    assert chosen == reference[0].argmax().item()
    # fp32 arithmetic: the logprob equals the fp32 reference's, not a bf16 rounding of it
    assert out.logprobs[0][chosen] == reference[0, chosen].item()
    penalized = logits[1].float().clone()
    seen = torch.tensor([1, 2, 3])
    penalized[seen] = torch.where(penalized[seen] > 0, penalized[seen] / 1.3, penalized[seen] * 1.3)
    assert out.token_ids[1] == penalized.argmax().item()


def test_logit_bias_is_added_before_the_penalties_as_transformers_and_vllm_do():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    logits = torch.tensor([[2.0, 2.9, -5.0, -1.0], [-0.5, -1.2, -5.0, 0.3]])
    prompt = [0, 3]
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 2.0}),
              SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 1.0, 3: -1.0})]  # fmt: skip
    batch = [Sequence(f"s{i}", prompt, p, num_prompt_tokens=2) for i, p in enumerate(params)]
    expected = []
    for row, p in zip(logits, params):
        scores, ids = row[None].clone(), torch.tensor([prompt])
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, scores)
        expected.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores).argmax().item())
    # penalised after the bias: (2 + 2) / 2 < 2.9; and (-0.5 + 1) / 2 > (0.3 - 1) * 2, -1.2
    assert expected == [1, 0]
    assert sample(logits.clone(), batch).token_ids == expected


def test_logprobs_are_the_raw_model_distribution_whatever_changes_the_draw():
    # vLLM's default logprobs_mode, raw_logprobs: the log-softmax of the model's logits, before
    # temperature, penalties, logit_bias and the filters; the chosen token's entry is of the same
    logits = bf16_logits(1)
    forced = int(logits[0].float().argmin())
    params = SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logit_bias={forced: 100.0}, logprobs=4)
    out = sample(logits.clone(), seqs(params))
    raw = logits[0].float().log_softmax(-1)
    assert out.token_ids == [forced]
    top = raw.topk(4)
    assert out.logprobs[0] == {forced: raw[forced].item(), **dict(zip(top.indices.tolist(), top.values.tolist()))}
