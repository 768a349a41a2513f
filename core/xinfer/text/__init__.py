"""Text in and out of a model: tokenizer, chat templates, streaming detokenizer."""

from xinfer.text.chat_template import ChatTemplate, ChatTemplateError
from xinfer.text.detokenizer import IncrementalDetokenizer
from xinfer.text.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
