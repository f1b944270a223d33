"""Pull one request's KV from every stage of a WavePP pipeline; standard library and torch only.

``KVTransport`` is the extension point: ``pull(params)`` returns checkpoint layer i's cache as a
tensor [parts, num_tokens, num_kv_heads, head_dim] for every layer (K/V: parts 2; an MLA
latent: parts 1, one head; ``wavepp.api.kv_handoff``), having released the stages'
leases. ``TcpTransport`` (the default) speaks ``wavepp.api.kv_handoff``'s framed, authenticated
protocol, one connection per stage, stages pulled concurrently (one thread each). Any failure
raises ``HandoffError`` naming the stage and the cause; the stages release their lease when the
connection breaks, or when it expires.

A transport over an RDMA library (NIXL, Mooncake's transfer engine) implements ``pull`` by
reading the stages' registered cache regions: the token check, the lease and the release stay
on the TCP control connection (the ``pull`` answer would carry the regions' descriptors instead
of the bytes); see docs/pd.md.
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from wavepp.api.kv_handoff import (
    HandoffError,
    HandoffParams,
    StageEndpoint,
    expires_text,
    read_frame,
    read_json,
    write_json,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class PulledKV:
    """A request's KV from every stage: ``layers[i]`` is checkpoint layer i's
    [parts, num_tokens, num_kv_heads, head_dim]; ``num_bytes`` received; ``seconds`` wall."""

    layers: list[torch.Tensor]
    num_tokens: int
    block_size: int
    num_bytes: int
    seconds: float


def _ask(params: HandoffParams, op: str) -> dict[str, object]:
    ask: dict[str, object] = {
        "op": op,
        "request_id": params.request_id,
        "expires": float(expires_text(params.expires)),
        "token": params.token,
    }
    if op == "pull" and params.traceparent:
        ask["traceparent"] = params.traceparent
    return ask


def pull_stage(
    params: HandoffParams, stage: StageEndpoint, *, timeout_s: float = 30.0
) -> tuple[list[torch.Tensor], int, int]:
    """One stage's layers of the request: (tensors by layer, bytes received, block size).

    Raises:
        HandoffError: the stage refused (its error), the connection failed, or a frame does not
            match the announced shape.
    """
    where = f"stage {stage.addr} (layers [{stage.first_layer}, {stage.last_layer}))"
    try:
        with socket.create_connection(stage.host_port, timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            write_json(sock, _ask(params, "pull"))
            head = read_json(sock)
            if not head.get("ok"):
                raise HandoffError(f"{where}: {head.get('error', 'refused')}")
            num_tokens = int(head["num_tokens"])
            if (int(head["first_layer"]), int(head["last_layer"])) != (
                stage.first_layer,
                stage.last_layer,
            ):
                raise HandoffError(
                    f"{where}: serves layers [{head['first_layer']}, {head['last_layer']})"
                )
            dtype = _DTYPES.get(str(head["dtype"]))
            if dtype is None:
                raise HandoffError(f"{where}: dtype {head['dtype']!r} not supported")
            parts = int(head["parts"])
            if parts not in (1, 2):
                raise HandoffError(f"{where}: parts={parts}; 2 (K, V) or 1 (MLA latent)")
            shape = (parts, num_tokens, int(head["num_kv_heads"]), int(head["head_dim"]))
            expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            layers: list[torch.Tensor] = []
            received = 0
            for _ in range(stage.first_layer, stage.last_layer):
                raw = read_frame(sock)
                if len(raw) != expected:
                    raise HandoffError(f"{where}: a layer of {len(raw)} bytes, {expected} expected")
                layers.append(torch.frombuffer(raw, dtype=dtype).view(shape))
                received += len(raw)
            write_json(sock, _ask(params, "release"))
            done = read_json(sock)
            if not done.get("ok"):
                raise HandoffError(f"{where}: release: {done.get('error', 'refused')}")
            return layers, received, int(head["block_size"])
    except (OSError, KeyError, ValueError) as exc:
        raise HandoffError(f"{where}: {exc!r}") from exc


class KVTransport(ABC):
    """How the decode side gets a handed-off request's KV from the stages."""

    @abstractmethod
    def pull(self, params: HandoffParams) -> PulledKV:
        """Every layer's K/V of the request (``PulledKV.layers[i]``: checkpoint layer i), the
        stages' leases released. Raises ``HandoffError`` naming the stage and the cause."""


class TcpTransport(KVTransport):
    """``wavepp.api.kv_handoff``'s TCP protocol; ``timeout_s`` per socket operation."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def pull(self, params: HandoffParams) -> PulledKV:
        return pull_request(params, timeout_s=self.timeout_s)


def pull_request(params: HandoffParams, *, timeout_s: float = 30.0) -> PulledKV:
    """Every stage's layers of the request over TCP, concurrently (module docstring)."""
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(params.stages)) as pool:
        parts = list(pool.map(lambda s: pull_stage(params, s, timeout_s=timeout_s), params.stages))
    layers = [t for part in parts for t in part[0]]
    return PulledKV(
        layers=layers,
        num_tokens=params.num_tokens,
        block_size=parts[0][2],
        num_bytes=sum(part[1] for part in parts),
        seconds=time.perf_counter() - began,
    )


def stage_stats(addr: str, *, timeout_s: float = 10.0) -> dict[str, object]:
    """A stage transfer server's ``stats`` answer (open leases, pinned blocks, counters)."""
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        write_json(sock, {"op": "stats"})
        return read_json(sock)
