"""Terminal chat: ``python -m xinfer.chat [flags]`` or ``xinfer --i [flags]``.

The engine runs in this process. Answers stream as they are generated; the
conversation is kept (oldest turns dropped when it outgrows the context).
Commands: ``/exit`` (or Ctrl+D), ``/clear``, ``/system TEXT``, ``/help``; another line starting with a ``/``
word is an unknown command.
Ctrl+C stops the answer being written.

``xinfer --prompts "a|b" [--batch N]`` answers the prompts (N copies of them as
one batch) and prints the answers and the throughput instead.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from xinfer.cli import exit_at_next_interrupt
from xinfer.engine.engine import LLMEngine
from xinfer.engine.output import OutputProcessor, RequestOutput
from xinfer.loading.errors import first_line
from xinfer.sampling import SamplingParams
from xinfer.text.tokenizer import has_tokenizer

if TYPE_CHECKING:
    from xinfer.server.params import SamplingDefaults

log = logging.getLogger("xinfer")

HELP = "commands: /exit, /clear (forget the conversation), /system TEXT (set a system prompt), /help"


class Conversation:
    def __init__(self, engine: LLMEngine, params: SamplingParams, think: bool = True):
        """``engine``'s tokenizer has a chat template (:func:`run` checks). ``think``: False asks the template
        not to think (``enable_thinking=false``, as ``--disable-reasoning`` does on the server)."""
        self.engine = engine
        self.tokenizer, self.template = engine.tokenizer, engine.tokenizer.chat_template
        self.processor = OutputProcessor(engine)
        self.params = params
        self.template_kwargs = {} if think else {"enable_thinking": False}
        self.system: str | None = None
        self.turns: list[dict[str, str]] = []
        self._ids = itertools.count()

    def messages(self, turns: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + (self.turns if turns is None else turns)

    def prompt(self) -> list[int]:
        """The conversation's tokens, dropping the oldest turns until an answer fits (an answer takes at most
        half the context); a last message that does not fit alone is refused, the history kept."""
        context = self.engine.max_model_len
        room = context - min(self.params.max_tokens or 1, context // 2)
        turns = self.turns
        while True:
            text = self.template.render(self.messages(turns), add_generation_prompt=True, **self.template_kwargs)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(token_ids) <= room:
                self.turns = turns
                return token_ids
            if len(turns) <= 1:
                raise ValueError(
                    f"the message takes {len(token_ids)} tokens with the chat template, over the {room} a prompt may "
                    f"take in a context of {context} (--max-model-len) with room for the answer: shorten it"
                )
            turns = turns[2:]

    def reply(self, user_text: str, out: TextIO) -> str:
        """Streams the answer to ``user_text``; Ctrl+C stops it (the chat goes on: with the part answered, or
        without the turn where nothing was)."""
        self.turns.append({"role": "user", "content": user_text})
        answer = None
        try:
            prompt = self.prompt()
            limit = min(self.params.max_tokens or self.engine.max_model_len, self.engine.max_model_len - len(prompt))
            answer = self.processor.add(f"chat-{next(self._ids)}", prompt, replace(self.params, max_tokens=limit))
            for delta in self.processor.run([answer]):
                out.write(delta.outputs[0].text)
                out.flush()
        except KeyboardInterrupt:
            if answer is not None:
                self.processor.abort(answer.request_id)
            out.write(" [stopped]")
        out.write("\n")
        text = answer.outputs[0].text if answer is not None else ""
        if text:
            self.turns.append({"role": "assistant", "content": text})
        else:  # stopped before its first token: a question left unanswered would be answered with the next
            self.turns.pop()
        return text


def chat_loop(
    conversation: Conversation, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> None:
    """The chat: answers on ``out`` (so that ``echo hi | xinfer --i > answer.txt`` keeps the answer alone), the
    banner and what is refused on ``err``."""
    interactive = stdin.isatty()
    err.write(f"xinfer chat ({HELP})\n")
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        line = stdin.readline()
        if not line:
            if interactive:  # Ctrl+D: the shell's prompt on a line of its own
                out.write("\n")
            break
        line = as_text(line).strip()
        if not line:
            continue
        command, _, argument = line.partition(" ")
        if command in ("/exit", "/quit", "/bye"):
            break
        if command == "/clear":
            conversation.turns.clear()
        elif command == "/system":
            conversation.system = argument.strip() or None
        elif command == "/help":
            err.write(HELP + "\n")
        elif command.startswith("/"):
            err.write(f"unknown command {command} ({HELP})\n")
        else:
            try:
                conversation.reply(line, out)
            except ValueError as error:  # a turn the engine refuses: said in one line, the chat goes on without it
                conversation.turns.pop()
                err.write(f"xinfer: {first_line(error)}\n")


def as_text(line: str) -> str:
    """Terminal input as text: bytes that are not UTF-8 (which Python's reading keeps as lone surrogates, which
    the tokenizer refuses) as U+FFFD."""
    return line.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def answer_all(engine: LLMEngine, prompts: list[str], params: SamplingParams, out: TextIO = sys.stdout) -> None:
    """Runs the prompts as one batch (each as a user turn when the model has a chat template); ``engine`` has a
    tokenizer (:func:`run` checks)."""
    tokenizer = engine.tokenizer
    template = tokenizer.chat_template
    processor = OutputProcessor(engine)
    answers = []
    for i, prompt in enumerate(prompts):
        if template is not None:
            prompt = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        answers.append(processor.add(str(i), tokenizer.encode(prompt, add_special_tokens=template is None), params))
    start = time.perf_counter()
    try:
        for _ in processor.run(answers):
            pass
    except KeyboardInterrupt:  # the answers so far, the unfinished marked, before the interrupt ends the command
        write_answers(prompts, answers, out)
        raise
    seconds = time.perf_counter() - start
    num_tokens = sum(a.usage["completion_tokens"] for a in answers)
    write_answers(prompts, answers, out)
    out.write(f"{len(prompts)} requests, {num_tokens} tokens in {seconds:.2f} s: {num_tokens / seconds:.1f} tok/s\n")


def write_answers(prompts: list[str], answers: list[RequestOutput], out: TextIO) -> None:
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        stopped = "" if answer.finished else " [stopped]"
        out.write(f"[{i}] {prompt}\n{answer.outputs[0].text.strip()}{stopped}\n\n")


def run(args: argparse.Namespace) -> int:
    from xinfer.server.launch import prepare, sampling_defaults

    path, config = prepare(args)
    if not has_tokenizer(path):
        print(f"xinfer: {path} has no tokenizer.json; the terminal needs the model's tokenizer", file=sys.stderr)
        return 2
    print(f"loading {path} ...", file=sys.stderr)
    try:
        engine = LLMEngine(config)
    except Exception as error:  # one line, as the server reports it (the traceback with --log debug)
        log.debug("loading the model failed", exc_info=True)
        print(f"xinfer: loading the model failed: {first_line(error)}", file=sys.stderr)
        return 1
    try:  # under tensor parallelism, the other ranks' processes end with the engine
        return _answer(args, engine, sampling_defaults(args, path))
    finally:
        engine.shutdown()


def _answer(args: argparse.Namespace, engine: LLMEngine, defaults: SamplingDefaults) -> int:
    """``--prompts`` as one batch, else the chat."""
    from xinfer.server.args import split_prompts

    if engine.tokenizer.chat_template is None and not args.prompts:
        print("xinfer: this model has no chat template; the terminal chat needs one", file=sys.stderr)
        return 2
    params = SamplingParams(
        **defaults.sampling() | {"max_tokens": defaults.token_limit(None, 1024, engine.max_model_len)}
    )
    if args.prompts:
        prompts = split_prompts(as_text(args.prompts))
        try:
            answer_all(engine, prompts * (args.batch or 1), params)
        except ValueError as error:  # a prompt the engine refuses (longer than the context, ...)
            print(f"xinfer: {first_line(error)}", file=sys.stderr)
            return 2
        return 0
    try:
        chat_loop(Conversation(engine, params, think=not args.disable_reasoning))
    except KeyboardInterrupt:  # the chat ends
        exit_at_next_interrupt()
        print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m xinfer.chat``: ``xinfer chat``, its logging and its one-line Ctrl+C included."""
    from xinfer.cli import main as xinfer

    try:
        return xinfer(["chat", *(sys.argv[1:] if argv is None else argv)])
    finally:
        if argv is None:
            exit_at_next_interrupt()


if __name__ == "__main__":
    sys.exit(main())
