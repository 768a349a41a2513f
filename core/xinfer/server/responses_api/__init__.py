"""OpenAI's Responses API (``POST /v1/responses``): its bodies, their translation into a chat
request the engine runs, and answers in the Responses API's objects and events."""
