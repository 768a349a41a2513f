"""Text in and out of a model: tokenizer, chat templates, streaming detokenizer."""
