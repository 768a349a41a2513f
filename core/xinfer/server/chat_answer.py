"""A chat completion's answer, whole or streamed: the route's, and what the Responses API and the MCP loop
build theirs from."""

from __future__ import annotations

from collections.abc import AsyncIterator

from xinfer.engine.async_engine import RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.logprob import Logprob
from xinfer.server.logprobs import chat_logprobs
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    ToolCallDeltaItem,
    ToolCallItem,
)
from xinfer.server.serving import Serving
from xinfer.server.streaming import Answer
from xinfer.server.tools import ToolUse
from xinfer.text.reasoning import ReasoningStream, ReasoningTags, reasoning_token_count, split
from xinfer.toolcalls import ToolCallStream


class ChatAnswer(Answer):
    id_prefix, whole_type, chunk_type = "chatcmpl", ChatCompletion, ChatCompletionChunk
    body: ChatCompletionRequest

    def __init__(
        self,
        serving: Serving,
        body: ChatCompletionRequest,
        handle: RequestHandle,
        tags: ReasoningTags | None = None,
        inside: bool = False,
        tools: ToolUse | None = None,
    ):
        super().__init__(serving, body, handle)
        self.tags, self.inside = tags, inside
        self.tools = tools or ToolUse()
        self.call_streams: list[ToolCallStream | None] = []  # each streamed choice's calls

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or entries is None:
            return None
        body, serving = self.body, self.serving
        n = body.top_logprobs or 0
        return ChatLogprobs(content=chat_logprobs(token_ids, entries, n, serving.token_text, serving.token_bytes,
                                                  body.return_tokens_as_token_ids))  # fmt: skip

    def choice(self, index: int, output: CompletionOutput) -> ChatChoice:
        reasoning, answer = split(output.text, self.tags, self.inside) if self.tags else (None, output.text)
        content: str | None = answer
        calls: list[ToolCallItem] | None = None
        parser = self.tools.parser
        if parser is not None:
            parsed = parser.parse(answer)
            found = self.tools.given(parsed.tool_calls)
            if found:
                content = parsed.content
                calls = [
                    ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in found
                ]
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=calls),
            logprobs=self.logprobs(output.token_ids, output.logprobs),
            finish_reason=finish_reason(output.finish_reason, bool(calls) and self.tools.finishes_with_calls),
            stop_reason=output.stop_reason,
            token_ids=self.body.returned_ids(output.token_ids),
        )

    def whole(self, choices: list[ChatChoice]) -> ChatCompletion:
        return ChatCompletion(id=self.id, model=self.serving.model_name, choices=choices, usage=self.usage(),
                              prompt_logprobs=self.prompt_logprobs(0),
                              prompt_token_ids=self.prompt_token_ids())  # fmt: skip

    def prompt_token_ids(self) -> list[int] | None:
        return self.body.returned_ids(self.handle.outputs[0].prompt_token_ids)

    def reasoning_tokens(self) -> int:
        """As OpenAI counts them on every chat completion: 0 where the model does not reason."""
        return sum(self.reasoning_length(c.token_ids) for c in self.handle.choices)

    def reasoning_length(self, token_ids: list[int]) -> int:
        """How many of an output's first tokens are its reasoning (the end tag included)."""
        if self.tags is None:
            return 0
        tokenizer = self.serving.tokenizer
        start, end = tokenizer.token_to_id(self.tags.start), tokenizer.token_to_id(self.tags.end)
        return reasoning_token_count(token_ids, start, end, self.inside)

    async def events(self) -> AsyncIterator[str]:
        for index in range(self.body.n):  # (each with the prompt's token ids where asked for, as vLLM's)
            role = ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))
            yield self.chunk(role, self.prompt_token_ids())
        async for choice in self.deltas():
            yield self.chunk(choice)

    async def deltas(self) -> AsyncIterator[ChatChunkChoice]:
        """The streamed choices' deltas (the first, with the role, not among them)."""
        splits = [ReasoningStream(self.tags, self.inside) if self.tags else None for _ in range(self.body.n)]
        parser = self.tools.parser
        calls = self.call_streams = [parser.stream() if parser is not None else None for _ in range(self.body.n)]
        async for index, out in self.serving.engine.stream(self.handle):
            logprobs = self.logprobs(out.token_ids, out.logprobs) if out.token_ids else None
            reasoning, content = "", out.text
            stream = splits[index]
            if stream is not None:
                reasoning, content = stream.push(out.text)
                if out.finished():
                    more_reasoning, more_content = stream.finish()
                    reasoning, content = reasoning + more_reasoning, content + more_content
            pieces: list[ToolCallDeltaItem] = []
            call_stream = calls[index]
            if call_stream is not None:
                content, pieces = self._tool_deltas(call_stream, content, out.finished())
            token_ids = self.body.returned_ids(out.token_ids)
            if not (reasoning or content or pieces or out.finished() or logprobs is not None or token_ids):
                continue  # text held back (a possible stop string, tag or call, an unfinished character)
            delta = Delta(content=content or None, reasoning_content=reasoning or None, tool_calls=pieces or None)
            called = call_stream is not None and bool(call_stream.calls) and self.tools.finishes_with_calls
            reason = finish_reason(out.finish_reason, called) if out.finished() else None
            yield ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason,
                                  stop_reason=out.stop_reason, token_ids=token_ids)  # fmt: skip

    def _tool_deltas(self, stream: ToolCallStream, text: str, finished: bool) -> tuple[str, list[ToolCallDeltaItem]]:
        """The content and the pieces of tool calls that ``text`` settles (only the first
        call where parallel calls are off)."""
        deltas = [stream.push(text)] + ([stream.finish()] if finished else [])
        content = "".join(d.content for d in deltas)
        pieces = [
            ToolCallDeltaItem(
                index=piece.index,
                id=piece.id,
                type="function" if piece.id is not None else None,
                function=FunctionCallDelta(name=piece.name, arguments=piece.arguments),
            )
            for d in deltas
            for piece in d.tool_calls
            if self.tools.parallel or piece.index == 0
        ]
        return content, pieces


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` where an answer that ended by itself called tools."""
    return "tool_calls" if called and reason == "stop" else reason
