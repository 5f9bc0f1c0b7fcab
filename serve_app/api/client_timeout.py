"""How long a client waits for its answer, from its request's headers.

Our own `X-Request-Timeout: <seconds>` first (the whole request, documented in the
README), then what the openai and anthropic SDKs send on every request: their read
timeout (`x-stainless-read-timeout`, `x-stainless-timeout`), which for a request that
is not streamed is the whole answer's time. The replica's admission refuses at once what
it predicts it cannot finish within it (mlx_worker/scheduling/admission.py).

The deadline is kept per HTTP request in a context variable, set when the ingress reads
the body, so every replica call the request makes sends the time it has left.
"""

import contextvars
import math
import time
from typing import Mapping, Optional

HEADERS = ("x-request-timeout", "x-stainless-read-timeout", "x-stainless-timeout")

_deadline: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar("macfarm_deadline", default=None)


def start(headers: Mapping[str, str]) -> None:
    """The request has arrived: its deadline (time.monotonic()) from its headers."""
    _deadline.set(None)
    for name in HEADERS:
        try:
            seconds = float(headers.get(name, ""))
        except ValueError:
            continue
        if math.isfinite(seconds) and seconds > 0:
            _deadline.set(time.monotonic() + seconds)
            return


def seconds_left() -> Optional[float]:
    """The time the current request has left; None: its client did not say."""
    deadline = _deadline.get()
    return None if deadline is None else max(1e-3, deadline - time.monotonic())
