"""One engine over several processes (one per Mac): tensor- or pipeline-parallel ranks.

Every rank loads only its shard of the model (mlx-lm's `model.shard(group)`: a slice of
every layer; or `model.model.pipeline(group)`: a run of whole layers) and runs the same
engine loop; the forwards' collectives go over mx.distributed (`ring` over TCP, or
`jaccl` over Thunderbolt RDMA). Rank 0 (the leader) owns the requests. The other ranks
(followers) replay its schedule: the scheduler, page manager and prefix cache are
deterministic, so a follower needs only what the leader's loop took in on each
iteration (requests added, with their sampling seeds, aborts, the step cost fit that
sizes steps in time, and stop), which the leader sends over a TCP side channel before it
builds that iteration's step. Sampling needs no
exchange: after the forward's last collective the logits are the same on every rank,
and a sample is a function of (logits, seed, step).
"""

import contextlib
import json
import os
import pickle
import select
import socket
import struct
import tempfile
import time
from typing import List, Optional, Sequence

import mlx.core as mx

BACKENDS = ("ring", "jaccl")
CONNECT_TIMEOUT_S = 120.0


class RankLost(RuntimeError):
    """A rank of the group went away: the group cannot run another step."""


def init_group(rank: int, hosts: Sequence[str], backend: str = "ring",
               rdma_devices: Optional[List[List[Optional[str]]]] = None) -> mx.distributed.Group:
    """Join the group of len(hosts) ranks; blocks until every rank has joined. `hosts`
    are "ip:port" addresses, one per rank in rank order: ring listens on them, jaccl
    uses rank 0's as its coordinator. jaccl also needs `rdma_devices`, the matrix of
    RDMA device names between ranks (row i, column j: rank i's device to rank j; None
    on the diagonal), as `mlx.launch`'s hostfile gives it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not mx.distributed.is_available(backend):
        raise RuntimeError(f"mx.distributed backend {backend!r} is not available on this machine "
                           f"(jaccl needs macOS 26.2+ with RDMA over Thunderbolt enabled)")
    if backend == "ring":
        os.environ["MLX_HOSTFILE"] = _write_json([[h] for h in hosts])
    else:
        if rdma_devices is None or len(rdma_devices) != len(hosts):
            raise ValueError("the jaccl backend needs rdma_devices: one row per rank (see docs/cluster.md)")
        os.environ["MLX_IBV_DEVICES"] = _write_json(rdma_devices)
        os.environ["MLX_JACCL_COORDINATOR"] = hosts[0]
    os.environ["MLX_RANK"] = str(rank)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except Exception as e:  # noqa: BLE001 - say which group could not start
        raise RuntimeError(f"rank {rank} could not join the {backend} group {list(hosts)}: {e}") from e
    finally:
        for var in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
            with contextlib.suppress(KeyError, OSError):
                os.remove(os.environ.pop(var))  # read by init: a temporary file
    if group.size() != len(hosts):
        raise RuntimeError(f"joined a group of {group.size()} ranks, expected {len(hosts)}")
    return group


def _write_json(value) -> str:
    fd, path = tempfile.mkstemp(prefix="macfarm-group-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    return path


def group_min(group: Optional[mx.distributed.Group], value: int) -> int:
    """The smallest `value` over the group's ranks (every rank must call it). A step's
    collectives still in flight (on the device's stream) finish first, so that this one's
    messages never interleave with theirs."""
    if group is None or group.size() == 1:
        return value
    mx.synchronize()
    values = mx.distributed.all_gather(mx.array([value], mx.int64), group=group, stream=mx.cpu)
    return int(values.min().item())


def rank0s(x: mx.array, group: Optional[mx.distributed.Group]) -> mx.array:
    """Rank 0's `x` on every rank, still lazy (an all_sum in the graph): what every rank
    must agree on even if their arithmetic differed (a drafter's tokens)."""
    if group is None or group.size() == 1:
        return x
    return mx.distributed.all_sum(x if group.rank() == 0 else mx.zeros_like(x), group=group)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class CommandChannel:
    """The leader's per-iteration message to its followers: a length-prefixed pickle."""

    def __init__(self, socks: List[socket.socket]):
        self.socks = socks
        self.num_sent, self.send_s = 0, 0.0  # messages sent and the time it took (the per-step cost)
        for s in socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def listen(cls, port: int, followers: int, timeout: float = CONNECT_TIMEOUT_S) -> "CommandChannel":
        """Leader: accept `followers` connections on `port`."""
        server = socket.create_server(("", port))
        deadline, socks = time.monotonic() + timeout, []
        try:
            while len(socks) < followers:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                socks.append(server.accept()[0])
        except socket.timeout as e:
            for s in socks:
                s.close()
            raise RuntimeError(f"{followers - len(socks)} of {followers} follower ranks did not reach the leader "
                               f"on port {port} within {timeout:.0f} s: the group cannot start") from e
        finally:
            server.close()
        for s in socks:
            s.settimeout(None)
        return cls(socks)

    @classmethod
    def connect(cls, address: str, timeout: float = CONNECT_TIMEOUT_S) -> "CommandChannel":
        """Follower: connect to the leader's "ip:port", retrying until it listens."""
        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls([socket.create_connection((host, int(port)), timeout=5)])
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"could not reach the leader at {address}")
                time.sleep(0.1)

    def send(self, commands: list) -> None:
        t = time.perf_counter()
        data = pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL)
        message = struct.pack("!I", len(data)) + data
        for s in self.socks:
            try:
                s.sendall(message)
            except OSError as e:
                raise RankLost(f"a follower rank is gone ({e})") from e
        self.num_sent += 1
        self.send_s += time.perf_counter() - t

    def peer_gone(self) -> bool:
        """Whether a peer closed its end (followers never send: readable means closed)."""
        readable, _, _ = select.select(self.socks, [], [], 0)
        for s in readable:
            try:
                if not s.recv(1, socket.MSG_PEEK):
                    return True
            except OSError:
                return True
        return False

    def recv(self) -> list:
        s = self.socks[0]
        s.settimeout(None)
        (n,) = struct.unpack("!I", self._read(s, 4))
        return pickle.loads(self._read(s, n))

    @staticmethod
    def _read(s: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise RankLost("the leader rank is gone")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            except OSError:
                pass
            s.close()


class Ranks:
    """This process's place in an engine's group: `group` for the model's collectives,
    `channel` for the leader's commands."""

    def __init__(self, group: mx.distributed.Group, channel: CommandChannel):
        self.group, self.channel = group, channel
        self.rank, self.size = group.rank(), group.size()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def min(self, value: int) -> int:
        return group_min(self.group, value)


def start_ranks(rank: int, hosts: Sequence[str], leader_address: str, backend: str = "ring",
                rdma_devices: Optional[List[List[Optional[str]]]] = None,
                timeout: float = CONNECT_TIMEOUT_S) -> Ranks:
    """Join the leader's command channel (`leader_address`: "ip:port" the leader listens
    on), then the group (`hosts`: each rank's "ip:port" for the backend, see init_group).
    The channel comes first because it can time out: mx.distributed's join cannot (it
    blocks, holding the GIL, until every rank has come), so it starts only once every
    rank is known to be there."""
    if rank == 0:
        channel = CommandChannel.listen(int(leader_address.rsplit(":", 1)[1]), len(hosts) - 1, timeout)
    else:
        channel = CommandChannel.connect(leader_address, timeout)
    try:
        return Ranks(init_group(rank, hosts, backend, rdma_devices), channel)
    except BaseException:
        channel.close()
        raise
