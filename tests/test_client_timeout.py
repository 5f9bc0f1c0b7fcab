"""The client's timeout from its headers, and the time left that each replica call carries
(serve_app/api/client_timeout.py, Ingress._on_replica)."""

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.api import client_timeout
from serve_app.ingress import Ingress
from serve_app.replica_outcomes import Overloaded


def test_our_header_first_then_the_sdks_read_timeouts():
    async def left(headers):
        client_timeout.start(headers)
        return client_timeout.seconds_left()

    assert asyncio.run(left({"x-request-timeout": "30", "x-stainless-read-timeout": "600"})) == pytest.approx(30, abs=1)
    assert asyncio.run(left({"x-stainless-read-timeout": "600"})) == pytest.approx(600, abs=1)
    assert asyncio.run(left({"x-request-timeout": "soon", "x-stainless-timeout": "45"})) == pytest.approx(45, abs=1)
    assert asyncio.run(left({"x-request-timeout": "-1"})) is None and asyncio.run(left({})) is None


def test_a_retry_after_a_late_refusal_carries_the_time_its_client_has_left():
    """A replica's refusal can come late: a request taken, then withdrawn once it can no
    longer finish. The ingress's next try must carry the time the client has left by
    then, not its whole timeout, or a replica takes it for a client about to leave."""
    ingress = SimpleNamespace(args=SimpleNamespace(retry_after_s=1))  # for its retry loop alone
    model = SimpleNamespace(groups=None, generate={"replicas": None})
    sent = []

    async def replica_call(m, group, payload, hashes):
        sent.append((payload["timeout_s"], list(payload["avoid_engines"])))
        if len(sent) == 1:
            await asyncio.sleep(0.5)
            raise Overloaded("withdrawn: it would now finish past its timeout", 3.0, engine_id="a")
        return "taken"

    async def main():
        client_timeout.start({"x-request-timeout": "10"})
        return await Ingress.func_or_class._on_replica(ingress, model, {"rid": "r"}, [], replica_call)

    assert asyncio.run(main()) == "taken"
    (first, avoided_first), (retry, avoided_retry) = sent
    assert first == pytest.approx(10, abs=0.1) and retry <= first - 0.5
    assert avoided_first == [] and avoided_retry == ["a"]
