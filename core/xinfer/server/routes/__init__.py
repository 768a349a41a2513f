"""The API's routers, one file per group of routes."""

from xinfer.server.routes import chat, completions, embeddings, messages, responses, system, tokens

ROUTERS = (
    system.router,
    chat.router,
    completions.router,
    embeddings.router,
    tokens.router,
    messages.router,
    responses.router,
)
