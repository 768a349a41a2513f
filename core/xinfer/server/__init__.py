"""The OpenAI-compatible HTTP server: ``xinfer [flags]`` or ``python -m xinfer.server [flags]``.

Importing this package stays light (``xinfer --help`` should not import torch);
the app lives in :mod:`xinfer.server.app`, the launcher in :mod:`xinfer.server.launch`.
"""
