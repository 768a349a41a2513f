"""A Messages request as the chat request the engine runs: OpenAI's message shapes are
what chat templates read (``tool_calls`` on assistant turns, ``role: tool`` results).

- ``system`` (a string or text blocks) becomes the first, system message;
- consecutive messages of one role are one turn, as Anthropic's API combines them: their blocks in order,
  their texts joined as one message's text blocks are;
- a final assistant turn is a prefill: the answer continues its text (``continue_final_message``),
  as Anthropic's API does; an empty one is left out;
- a user turn's ``tool_result`` blocks become ``tool`` messages, in order, before its other content;
- an assistant turn's ``tool_use`` blocks become its ``tool_calls``, its ``thinking`` its ``reasoning_content``;
- an assistant turn's ``mcp_tool_use`` / ``mcp_tool_result`` blocks (the MCP calls xinfer ran, sent back)
  become, round by round, an assistant message with those ``tool_calls`` and the ``tool`` results after it;
- ``image`` blocks (a tool result's too) become ``image_url`` parts (data URLs), refused where the model takes
  text only;
- ``document`` blocks of plain text become text parts, the document (its title and context too)
  between tags as Anthropic's prompting guide lays documents out; PDFs and other sources are refused;
- ``tools`` become function tools, ``tool_choice`` OpenAI's (``any``: required, ``tool``: that function);
- ``thinking: {"type": "disabled"}`` asks the template not to think (``enable_thinking=false``);
- ``output_config.format`` (a JSON schema) is a strict ``json_schema`` response format (structured outputs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from xinfer.server.errors import bad_request, from_validation
from xinfer.server.messages.protocol import (
    Block,
    CountTokensRequest,
    Message,
    MessagesRequest,
    Source,
    Tool,
    ToolChoice,
)
from xinfer.server.prompts import FIELD, image_fields
from xinfer.server.protocol import ChatCompletionRequest

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_request(
    body: CountTokensRequest, takes_images: bool, extra_tools: list[dict[str, Any]] | None = None
) -> ChatCompletionRequest:
    """The chat request that ``body`` asks for (a count_tokens body: its prompt only);
    ``extra_tools`` (OpenAI's shape) are offered beside the request's own."""
    messages = chat_messages(body, takes_images)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    final = messages[-1]
    if final["role"] == "assistant" and not final.get("tool_calls"):
        if final["content"]:
            fields |= {"continue_final_message": True, "add_generation_prompt": False}
        else:
            messages.pop()
    tools = [*(function_tool(tool, i) for i, tool in enumerate(body.tools or [])), *(extra_tools or [])]
    if tools:
        fields["tools"] = tools
    if body.tool_choice is not None:
        fields["tool_choice"] = tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use is not None:
            fields["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if body.thinking is not None and body.thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, MessagesRequest):
        fields |= {"max_tokens": body.max_tokens, "stop": body.stop_sequences, "stream": body.stream}
        fields |= {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        output_format = body.output_config.format if body.output_config is not None else None
        if output_format is not None:
            schema = {"name": "output", "schema": output_format.json_schema, "strict": True}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    try:
        # through JSON, so that the chat body is checked exactly as one sent over HTTP
        request = ChatCompletionRequest.model_validate_json(json.dumps(fields))
    except ValidationError as error:
        raise from_validation(error) from None
    request._image_fields = image_fields(messages)
    return request


def chat_messages(body: CountTokensRequest, takes_images: bool) -> list[dict[str, Any]]:
    messages = []
    if body.system:
        messages.append({"role": "system", "content": block_text(body.system, "system")})
    conversation = turns(body.messages)
    for turn in conversation:
        messages += chat_turn(turn, takes_images)
    check_turns(body.messages, conversation)  # after each turn's blocks are checked
    return messages


@dataclass(frozen=True)
class Turn:
    """Consecutive messages of one role: one turn, as Anthropic's API combines them; each message with its
    index in the request, which errors name."""

    role: str
    messages: list[tuple[int, Message]]

    def blocks(self) -> list[tuple[str, Block]]:
        """The turn's blocks in order, each with where it is in the request (a string content: one text block)."""
        placed = []
        for i, message in self.messages:
            if isinstance(message.content, str):
                placed.append((f"messages.{i}.content", Block(type="text", text=message.content)))
            else:
                placed += [(f"messages.{i}.content.{j}", block) for j, block in enumerate(message.content)]
        return placed


def turns(messages: list[Message]) -> list[Turn]:
    conversation: list[Turn] = []
    for i, message in enumerate(messages):
        if not conversation or conversation[-1].role != message.role:
            conversation.append(Turn(message.role, []))
        conversation[-1].messages.append((i, message))
    return conversation


def check_turns(messages: list[Message], conversation: list[Turn]) -> None:
    """Anthropic's rules: content in each message (a final assistant one, the prefill, may be empty but not
    end in whitespace), and each ``tool_use`` answered by a ``tool_result`` in the next turn, each result
    answering one."""
    for i, message in enumerate(messages):
        check_text(message, f"messages.{i}", prefill=i == len(messages) - 1 and message.role == "assistant")
    for k, turn in enumerate(conversation):
        asked, answered = tool_uses(conversation[k - 1]) if k > 0 else {}, set()
        for where, block in turn.blocks():
            if block.type == "tool_result" and block.tool_use_id is not None:
                if block.tool_use_id not in asked:
                    raise bad_request(f"unexpected tool_use_id found in tool_result blocks: {block.tool_use_id}. "
                                      "Each tool_result block must have a corresponding tool_use block in the previous "
                                      "message", param=where)  # fmt: skip
                answered.add(block.tool_use_id)
        check_answered({use: i for use, i in asked.items() if use not in answered})
    check_answered(tool_uses(conversation[-1]))


def check_answered(unanswered: dict[str, int]) -> None:
    """``unanswered``: tool_use ids, each with the index of the message that holds it."""
    if unanswered:
        raise bad_request(f"tool_use ids were found without tool_result blocks immediately after: "
                          f"{', '.join(sorted(unanswered))}. Each tool_use block must have a corresponding "
                          "tool_result block in the next message", param=f"messages.{min(unanswered.values())}")  # fmt: skip


def check_text(message: Message, param: str, prefill: bool) -> None:
    content = message.content
    if not prefill and not (content.strip() if isinstance(content, str) else content):
        raise bad_request("all messages must have non-empty content except for the optional final assistant "
                          "message", param=param)  # fmt: skip
    for j, block in enumerate(blocks(message)):
        if block.type == "text" and block.text is not None and not block.text.strip():
            raise bad_request("text content blocks must contain non-whitespace text", param=f"{param}.content.{j}")
    last = content if isinstance(content, str) else (content[-1].text if content and content[-1].type == "text" else "")
    if prefill and last and last != last.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace", param=param)


def blocks(message: Message) -> list[Block]:
    return message.content if isinstance(message.content, list) else []


def tool_uses(turn: Turn) -> dict[str, int]:
    """The ids of an assistant turn's ``tool_use`` blocks, each with the index of the message that holds it."""
    if turn.role != "assistant":
        return {}
    return {block.id: i for i, message in turn.messages for block in blocks(message)
            if block.type == "tool_use" and block.id is not None}  # fmt: skip


def chat_turn(turn: Turn, takes_images: bool) -> list[dict[str, Any]]:
    """The chat messages of one turn."""
    placed = turn.blocks()
    if turn.role == "user":
        return round_messages("user", placed, takes_images)
    return [m for part in mcp_rounds(placed) for m in round_messages("assistant", part, takes_images)]


def mcp_rounds(placed: list[tuple[str, Block]]) -> list[list[tuple[str, Block]]]:
    """An assistant turn's blocks by round: a turn xinfer answered after running MCP calls holds each
    round's text and ``mcp_tool_use`` blocks, then their ``mcp_tool_result`` blocks, then the next round's."""
    parts: list[list[tuple[str, Block]]] = [[]]
    for where, block in placed:
        if parts[-1] and parts[-1][-1][1].type == "mcp_tool_result" and block.type != "mcp_tool_result":
            parts.append([])
        parts[-1].append((where, block))
    return parts


def round_messages(role: str, placed: list[tuple[str, Block]], takes_images: bool) -> list[dict[str, Any]]:
    """The chat messages of a user turn, or of one round of an assistant turn (see :func:`mcp_rounds`):
    a user's tool results go before its message, the MCP results of an assistant round after it,
    as the model read them when the server ran the calls."""
    results: list[dict[str, Any]] = []  # tool messages
    parts: list[dict[str, Any]] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for where, block in placed:
        allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
        if block.type not in allowed:
            article = "an" if role == "assistant" else "a"
            raise bad_request(f"{article} {role} turn cannot hold a content block of type {block.type!r}", param=where)
        if block.type in CONTENT_BLOCKS:
            parts.append(content_part(block, where, takes_images))
        elif block.type in ("tool_result", "mcp_tool_result"):
            content = result_content(block.content or "", f"{where}.content", takes_images)
            if block.is_error and block.type == "tool_result":  # an MCP result's text is the one the model read
                content = f"Error: {content}" if isinstance(content, str) else [ERROR_PART, *content]
            results.append({"role": "tool", "tool_call_id": required(block.tool_use_id, where, "tool_use_id"),
                            "content": content})  # fmt: skip
        elif block.type in ("tool_use", "mcp_tool_use"):
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append({"id": required(block.id, where, "id"), "type": "function",
                          "function": {"name": required(block.name, where, "name"), "arguments": arguments}})  # fmt: skip
        elif block.type == "thinking" and block.thinking:
            reasoning.append(block.thinking)
    if results and not (parts or calls or reasoning):  # tool results alone
        return results
    chat: dict[str, Any] = {"role": role, "content": joined(parts)}
    if calls:
        chat["tool_calls"] = calls
    if reasoning:
        chat["reasoning_content"] = "\n".join(reasoning)
    return [*results, chat] if role == "user" else [chat, *results]


USER_BLOCKS = frozenset({"text", "image", "document", "tool_result"})
ASSISTANT_BLOCKS = frozenset({"text", "tool_use", "thinking", "redacted_thinking", "mcp_tool_use", "mcp_tool_result"})


def joined(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text parts as one string (none: "", which every template renders, where some read no missing
    content); parts with an image kept as parts."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def block_text(content: str | list[Block], param: str) -> str:
    """The text of a string or of text blocks (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text":
            raise bad_request(f"only text blocks are supported here, not {block.type!r}", param=f"{param}.{j}")
        texts.append(required(block.text, f"{param}.{j}", "text"))
    return "\n".join(texts)


CONTENT_BLOCKS = frozenset({"text", "image", "document"})  # what a message's content and a tool result's hold


def content_part(block: Block, where: str, takes_images: bool) -> dict[str, Any]:
    """A text, image or document block as a chat content part; an image refused where the model takes text only
    (here, where the block's place in the Anthropic body is known)."""
    if block.type == "text":
        return {"type": "text", "text": required(block.text, where, "text")}
    if block.type == "document":
        return {"type": "text", "text": document_text(block, where)}
    if not takes_images:
        raise bad_request("this model takes text only: it cannot read images", param=where)
    return image_part(block, where)


def result_content(content: str | list[Block], param: str, takes_images: bool) -> str | list[dict[str, Any]]:
    """A tool result's content: its text, or, where it holds images, its blocks as parts."""
    if isinstance(content, str) or all(block.type == "text" for block in content):
        return block_text(content, param)
    parts = []
    for j, block in enumerate(content):
        if block.type not in CONTENT_BLOCKS:
            raise bad_request(f"a tool_result holds text, image and document blocks, not {block.type!r}",
                              param=f"{param}.{j}")  # fmt: skip
        parts.append(content_part(block, f"{param}.{j}", takes_images))
    return joined(parts)


ERROR_PART = {"type": "text", "text": "Error: "}


def image_part(block: Block, param: str) -> dict[str, Any]:
    source = block.source
    if not isinstance(source, Source):
        raise bad_request("an image block needs a source object", param=param)
    if source.type == "base64" and source.data and source.media_type:
        url = f"data:{source.media_type};base64,{source.data}"
    elif source.type == "url" and source.url:
        url = source.url
    else:
        raise bad_request("an image source is {type: base64, media_type, data} or {type: url, url}", param=param)
    return {"type": "image_url", "image_url": {"url": url}, FIELD: f"{param}.source"}


def document_text(block: Block, param: str) -> str:
    """The document between tags, ending its line (the turn's text parts are joined as they are)."""
    source = block.source
    if not isinstance(source, Source) or source.type != "text":
        given = f"of type {source.type!r}" if isinstance(source, Source) else "without a source object"
        raise bad_request(f"a document {given} is not supported: documents are plain text, a source "
                          '{"type": "text", "media_type": "text/plain", "data": ...}', param=f"{param}.source")  # fmt: skip
    if source.media_type != "text/plain" or source.data is None:
        raise bad_request('a text document\'s source is {"type": "text", "media_type": "text/plain", "data": ...}',
                          param=f"{param}.source")  # fmt: skip
    title = f"<title>{block.title}</title>\n" if block.title else ""
    context = f"<context>{block.context}</context>\n" if block.context else ""
    return f"<document>\n{title}{context}<document_content>\n{source.data}\n</document_content>\n</document>\n"


def function_tool(tool: Tool, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise bad_request(f"tool {tool.name!r} is a server tool ({tool.type}), which this server does not run",
                          param=f"tools.{index}")  # fmt: skip
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs the tool's name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return TOOL_CHOICES[choice.type]


def required(value: str | None, param: str, name: str) -> str:
    if value is None:
        raise bad_request(f"the block needs {name}", param=param)
    return value
