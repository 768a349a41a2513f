"""A request's own failure, told apart from the engine's.

Work done for one request (packing its tokens into a step, drawing its token with its
parameters and grammar, following its grammar, detokenizing it, cutting its stop strings)
that raises ends that request alone, with finish reason ``error`` and a message; the
other requests go on with the tokens they would have had. Any other exception in a step
(a kernel failing over the whole batch, a device error) ends the engine, as before.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from xinfer.loading.errors import first_line

if TYPE_CHECKING:
    from xinfer.engine.sequence import Sequence

log = logging.getLogger("xinfer")


class RequestFailed(Exception):
    """Work for one sequence failed: the step goes on without it."""

    def __init__(self, seq: Sequence, error: BaseException):
        super().__init__(f"{seq.request_id}: {describe(error)}")
        self.seq, self.error = seq, error


class RequestError(RuntimeError):
    """A request the engine failed (finish reason ``error``), raised where its caller reads it."""


def describe(error: BaseException) -> str:
    """``error`` in one line, for the request's caller and the log."""
    return f"{type(error).__name__}: {first_line(error)}"


def log_failure(request_id: str, error: BaseException) -> str:
    """Logs that ``request_id`` failed (the traceback with --log debug); returns the one-line reason."""
    reason = describe(error)
    log.error("request %s failed, the others go on: %s", request_id, reason)
    log.debug("request %s failed", request_id, exc_info=error)
    return reason
