"""The embedded default model (SmolLM2-135M-Instruct GGUF) answers through LLM.chat."""

from xinfer import LLM, SamplingParams

QUESTION = "What is the capital of France? Answer in one sentence."


def test_default_model_knows_the_capital_of_france():
    llm = LLM()  # no model named: the embedded default
    out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on the turn-end token, not on length
    assert "<|im_end|>" not in out.outputs[0].text
