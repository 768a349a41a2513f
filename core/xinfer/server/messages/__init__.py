"""Anthropic's Messages API (``POST /v1/messages``): its bodies, their translation into a
chat request the engine runs, and answers in Anthropic's shapes."""
