"""python -m xinfer.chat: streaming answers, history, /exit."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.server.live import REPO
from xinfer.chat import HELP, Conversation, chat_loop, run
from xinfer.engine.engine import StepOutput
from xinfer.sampling import SamplingParams
from xinfer.server.args import parse_args


class FakeTemplate:
    def render(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )


class FakeEngine:
    """Answers every prompt "ok!" in two steps; records the prompts it saw."""

    max_model_len = 64

    def __init__(self):
        self.tokenizer = SimpleNamespace(
            chat_template=FakeTemplate(),
            encode=lambda text, add_special_tokens: list(text.encode()),
            decode=lambda ids, skip_special_tokens: bytes(ids).decode(),
        )
        self.prompts, self.pending = [], []

    def add_request(self, request_id, prompt, params, multimodal=None):
        self.prompts.append(bytes(prompt).decode())
        self.pending = [StepOutput(request_id, list(b"ok")), StepOutput(request_id, list(b"!"), finish_reason="stop")]

    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        return [self.pending.pop(0)]

    def shutdown(self):
        self.shut_down = True


def test_conversation_keeps_history_and_drops_old_turns_when_full():
    engine = FakeEngine()
    conversation = Conversation(engine, SamplingParams(max_tokens=8))
    out = io.StringIO()
    chat_loop(conversation, io.StringIO("first\nsecond\n/exit\nnever sent\n"), out)
    assert engine.prompts == ["<user>first<assistant>", "<user>first<assistant>ok!<user>second<assistant>"]
    assert out.getvalue().count("ok!\n") == 2
    chat_loop(conversation, io.StringIO("third\n"), io.StringIO())
    assert engine.prompts[-1].startswith("<user>second")  # the oldest turn made room


class KeywordTemplate(FakeTemplate):
    def render(self, messages, add_generation_prompt=True, **kwargs):
        return super().render(messages, add_generation_prompt) + "".join(f"[{k}={v}]" for k, v in kwargs.items())


def test_commands_other_lines_starting_with_a_slash_and_bytes_that_are_not_utf8():
    """/systemd set the system prompt to "d"; another /word was answered with the help, saying nothing of it; a
    line of Latin-1 bytes was a traceback (the tokenizer refused its lone surrogates) and the chat lost."""
    engine = FakeEngine()
    conversation = Conversation(engine, SamplingParams(max_tokens=8))
    err = io.StringIO()
    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")
    chat_loop(conversation, io.StringIO(f"/systemd is slow\n/system be brief\n{latin1}\n"), io.StringIO(), err)
    assert "unknown command /systemd (commands:" in err.getvalue()
    assert engine.prompts == ["<system>be brief<user>caf\ufffd<assistant>"]


def test_disable_reasoning_asks_the_template_not_to_think():
    """--disable-reasoning was read by the server only: the chat's template still opened a thinking block."""
    engine = FakeEngine()
    engine.tokenizer.chat_template = KeywordTemplate()
    chat_loop(Conversation(engine, SamplingParams(max_tokens=8), think=False), io.StringIO("hi\n"), io.StringIO())
    assert engine.prompts == ["<user>hi<assistant>[enable_thinking=False]"]


def test_max_tokens_as_long_as_the_context_leaves_the_conversation_half():
    """``--max-tokens`` at the context's length took all of it, and the prompt was then sent whole (refused)."""
    engine = FakeEngine()
    limits = []
    add = engine.add_request
    engine.add_request = lambda request_id, prompt, params, *_: (
        limits.append(params.max_tokens),
        add(request_id, prompt, params),
    )
    chat_loop(Conversation(engine, SamplingParams(max_tokens=64)), io.StringIO("a question\n"), io.StringIO())
    prompt = engine.prompts[0]
    assert prompt == "<user>a question<assistant>" and limits == [64 - len(prompt)]


def test_a_message_too_long_for_the_context_is_refused_in_one_line_and_the_history_kept():
    """It was cut from the left to fit (its start and the template's start lost, silently)."""
    engine = FakeEngine()
    conversation = Conversation(engine, SamplingParams(max_tokens=8))
    err = io.StringIO()
    chat_loop(conversation, io.StringIO("first\n" + "x" * 60 + "\nsecond\n"), io.StringIO(), err)
    assert (
        "xinfer: the message takes 77 tokens with the chat template, over the 56 a prompt may take in a context of 64"
        in err.getvalue()
    )
    assert engine.prompts == ["<user>first<assistant>", "<user>first<assistant>ok!<user>second<assistant>"]


def test_python_m_xinfer_chat_streams_answers_and_exits(client, model):
    """Each answer is the server's greedy chat completion of the conversation so far: none before the second
    question, which comes after /clear."""
    questions = ["What is the capital of France?", "Name a color."]
    result = subprocess.run(
        [sys.executable, "-m", "xinfer.chat", "--max-model-len", "512", "--temperature", "0", "--max-tokens", "24"],
        input=f"{questions[0]}\n/clear\n{questions[1]}\n/exit\nnever sent\n",
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    replies = [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=24
        )
        for question in questions
    ]
    answers = [reply.choices[0].message.content for reply in replies]
    # the answers alone on stdout (echo ... | xinfer --i > answer.txt), the banner on stderr
    assert result.stdout == "".join(f"{answer}\n" for answer in answers)
    assert f"xinfer chat ({HELP})\n" in result.stderr


def test_an_engine_that_cannot_be_built_is_one_line_not_a_traceback(capsys, monkeypatch):
    """A failure past the checks start-up runs first (here one of several lines, as the memory plan's could be)
    ends the terminal chat as it ends the server: one line, exit status 1. One the checks find (a recent
    window beside an unquantized cache) ends it before the model loads, exit status 2."""
    import xinfer.chat

    def failing(config):
        raise ValueError("the KV cache holds 0 tokens (0 blocks of 16), fewer than max_model_len=8192\nmore")

    monkeypatch.setattr(xinfer.chat, "LLMEngine", failing)
    assert run(parse_args(["--cpu"])) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last == "xinfer: loading the model failed: the KV cache holds 0 tokens (0 blocks of 16), fewer than "
        "max_model_len=8192"
    )
    with pytest.raises(SystemExit) as exit_:
        run(parse_args(["--cpu", "--kv-recent-window", "16"]))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and line.startswith("xinfer: kv_recent_window (--kv-recent-window) keeps"), line


def test_a_prompt_the_engine_refuses_is_one_line(capsys, monkeypatch):
    """--prompts with a prompt the engine refuses (LLMEngine.add_request's, tests/engine/test_engine.py:
    longer than the context): one line, exit status 2."""
    import xinfer.chat

    class ShortEngine(FakeEngine):
        def add_request(self, request_id, prompt, params, multimodal=None):
            raise ValueError(f"the prompt has {len(prompt)} tokens, the model's context is 8 tokens: ...")

    engine = ShortEngine()
    monkeypatch.setattr(xinfer.chat, "LLMEngine", lambda config: engine)
    assert run(parse_args(["--cpu", "--prompts", "a long prompt"])) == 2
    assert engine.shut_down  # under tensor parallelism, the other ranks end with it
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last == "xinfer: the prompt has 30 tokens, the model's context is 8 tokens: ..."
    )  # <user>a long prompt<assistant>


def test_ctrl_c_before_the_first_token_drops_the_turn_and_the_chat_goes_on():
    """Ctrl+C while the prompt was built ended the whole chat; one before the first token kept the question with
    an empty answer, which the model then answered with the next question."""
    engine = FakeEngine()
    conversation = Conversation(engine, SamplingParams(max_tokens=8))
    render = engine.tokenizer.chat_template.render
    calls = []

    def interrupted_once(messages, add_generation_prompt=True):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return render(messages, add_generation_prompt)

    engine.tokenizer.chat_template.render = interrupted_once
    out = io.StringIO()
    chat_loop(conversation, io.StringIO("stopped\nasked\n"), out, io.StringIO())
    assert " [stopped]\n" in out.getvalue() and engine.prompts == ["<user>asked<assistant>"]


class InterruptedEngine(FakeEngine):
    """Finishes the first request's answer, then Ctrl+C comes."""

    def __init__(self):
        super().__init__()
        self.ids, self.steps = [], 0

    def add_request(self, request_id, prompt, params, multimodal=None):
        self.ids.append(request_id)

    def has_unfinished(self):
        return True

    def abort(self, sequence_id):
        pass

    def step(self):
        self.steps += 1
        if self.steps == 1:
            return [StepOutput(self.ids[0], list(b"done"), finish_reason="stop"), StepOutput(self.ids[1], list(b"ha"))]
        raise KeyboardInterrupt


def test_ctrl_c_in_prompts_mode_prints_the_answers_so_far():
    """--prompts printed nothing until every answer ended, and Ctrl+C threw the finished ones away."""
    from xinfer.chat import answer_all

    engine = InterruptedEngine()
    engine.tokenizer.chat_template = None
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        answer_all(engine, ["first", "second"], SamplingParams(max_tokens=8), out)
    assert out.getvalue() == "[0] first\ndone\n\n[1] second\nha [stopped]\n\n"


@pytest.mark.parametrize("gap", [0.02, 0.3])
def test_a_double_ctrl_c_ends_the_chat_without_a_traceback(gap):
    """Ctrl+C at the prompt ends the chat; a second one while the program exits (threads joined, memory freed)
    printed a traceback from the interpreter's exit. Now it ends at once: with 130, or, in the interpreter's last
    teardown (its handlers back to the default), by the signal, as a shell shows 130 too."""
    import os
    import pty
    import select
    import signal
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the chat, on a terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "xinfer.chat", "--max-model-len", "256"])
    seen = b""

    def read_until(done, timeout: float) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while not done() and time.monotonic() < end:
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the chat exited: the terminal closed
                    return

    read_until(lambda: b">>> " in seen, 300)
    assert b">>> " in seen, seen[-2000:]
    os.write(fd, b"\x03")
    time.sleep(gap)
    os.write(fd, b"\x03")
    read_until(lambda: False, 3)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert b"Traceback" not in seen, seen.decode(errors="replace")[-2000:]
    assert os.waitstatus_to_exitcode(status) in (130, -signal.SIGINT)
