"""A Messages answer after rounds of MCP calls (:mod:`xinfer.server.mcp.loop`): each round's
thinking and text, its calls and results as ``mcp_tool_use`` / ``mcp_tool_result`` blocks (the
shape of Anthropic's MCP connector), then the final answer's blocks."""

from __future__ import annotations

from xinfer.server.disconnect import unless_disconnected
from xinfer.server.mcp.loop import MCPRounds
from xinfer.server.messages.answer import MessageAnswer, stop_reason
from xinfer.server.messages.responses import (
    ContentBlock,
    MCPToolResultBlock,
    MCPToolUseBlock,
    MessageResponse,
    TextBlock,
    ToolUseBlock,
    message_id,
    usage,
)


async def message_with_mcp(rounds: MCPRounds) -> MessageResponse:
    engine = rounds.serving.engine
    content: list[ContentBlock] = []
    while True:
        handle, prompt = await rounds.submit()
        try:
            [output] = await unless_disconnected(rounds.request, engine.collect(handle))
        finally:
            engine.release(handle)
        rounds.count(handle)
        blocks, calls = MessageAnswer.read(prompt, output)
        if not rounds.runs([c.name for c in calls], output.finish_reason):
            content += blocks
            break
        content += [
            b for b in blocks if not isinstance(b, ToolUseBlock) and not (isinstance(b, TextBlock) and not b.text)
        ]
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        for ran in await rounds.run(text, calls):
            call = ran.call
            content.append(MCPToolUseBlock(id=call.id, name=call.name, server_name=ran.server, input=call.input))
            result = MCPToolResultBlock(
                tool_use_id=call.id, is_error=ran.is_error, content=[TextBlock(text=ran.output)]
            )
            content.append(result)
    reason, sequence = stop_reason(output, rounds.body.stop_strings)
    if calls and reason == "end_turn":
        reason = "tool_use"  # calls left to the client (not all the model's calls were to MCP tools), or rounds ran out
    return MessageResponse(id=message_id(), model=rounds.serving.model_name, content=content, stop_reason=reason,
                           stop_sequence=sequence,
                           usage=usage(rounds.prompt_tokens, rounds.output_tokens, rounds.cached_tokens))  # fmt: skip
