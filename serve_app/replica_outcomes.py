"""What a replica's answer means for the client: an engine error (400 or 500), a
refusal (429 with Retry-After), a replica that failed (503)."""

import math
from typing import Optional

from .api import protocol as P


def engine_error(out) -> "P.ProtocolError":
    """The engine ended the request with an error: the client's (a prompt the KV pool can
    never hold) is a 400, anything else a 500."""
    status = 400 if out.error_code == "context_length_exceeded" else 500
    return P.ProtocolError(out.error or "request failed", code=out.error_code, status=status)


def replica_error(err: dict) -> "P.ProtocolError":
    """An error the replica answered with before any output ({"error", "status", ...})."""
    if err.get("code") == "overloaded":
        return Overloaded(err["error"], err.get("retry_after_s") or 1, err.get("engine_id"))
    return P.ProtocolError(err["error"], code=err.get("code"), status=err.get("status", 400))


def replica_failed(e: Exception) -> "P.ProtocolError":
    return P.ProtocolError(f"the model replica failed ({type(e).__name__}); retry the request",
                           code="replica_failed", status=503)


class Overloaded(P.ProtocolError):
    """429 with Retry-After: refused at once (by a replica that predicts it cannot finish
    the request in time, or by Serve's queue limit)."""

    def __init__(self, message: str, retry_after_s: float, engine_id: Optional[str] = None):
        super().__init__(message, code="overloaded", status=429)
        self.retry_after, self.engine_id = max(1, math.ceil(retry_after_s)), engine_id
        self.headers = {"Retry-After": str(self.retry_after)}


def model_loading(name: str, retry_after_s: float = 10) -> "P.ProtocolError":
    """503 with Retry-After: the model was not loaded, and did not load within the client's timeout."""
    e = P.ProtocolError(f"model {name!r} is loading and was not ready within the request's timeout; retry later",
                        code="model_loading", status=503)
    e.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}
    return e
