"""ZeroMQ sockets and protocol messages: make, send, receive; sync for workers, async for
frontends and the orchestrator.

Every receive decodes with `common.protocol.decode`; a frame that is not a valid message (garbage,
an unknown tag, a peer speaking another protocol version) is dropped with one log line and the
caller sees None, so a bad sender can never crash a process.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from common.curve import serve
from common.protocol import Message, decode, encode

logger = logging.getLogger(__name__)

HIGH_WATER_MARK = 100_000  # messages queued per peer before send blocks (PUSH) or drops (ROUTER)


SocketT = TypeVar("SocketT", bound="zmq.Socket[Any]")  # a plain socket, or an asyncio one


def make_socket(
    context: zmq.Context[SocketT],
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
) -> SocketT:
    """A socket that never lingers at close (a dead peer must not hang shutdown)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a message to a departed peer is dropped
    if bind is not None:
        serve(sock)
        sock.bind(bind)
    if connect is not None:
        sock.connect(connect)
    return sock


def bind_random_port(
    sock: zmq.Socket[Any],
    host: str,
    advertise_host: str | None = None,
    port_range: tuple[int, int] | None = None,
) -> str:
    """Bind to a free TCP port on `host` (inside `port_range`, if given); returns the address
    peers connect to (on `advertise_host` when the bind address is not dialable, like 0.0.0.0
    in a pod)."""
    serve(sock)
    if port_range is None:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        low, high = port_range
        port = sock.bind_to_random_port(f"tcp://{host}", min_port=low, max_port=high + 1)
    return f"tcp://{advertise_host or host}:{port}"


def parse(frame: bytes, source: str) -> Message | None:
    try:
        return decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.warning(
            "dropped a malformed message from %s (%d bytes): %s", source, len(frame), exc
        )
        return None


# --- synchronous (worker loops) -------------------------------------------------------------------


def send(sock: zmq.Socket[bytes], message: Message) -> None:
    sock.send(encode(message))


def send_to(sock: zmq.Socket[bytes], identity: bytes, message: Message) -> None:
    """ROUTER: to the peer `identity`."""
    sock.send_multipart([identity, encode(message)])


def recv(sock: zmq.Socket[bytes], source: str) -> Message | None:
    """Non-blocking: the next message, or None when none is waiting or it was malformed."""
    try:
        frames = sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
    return parse(frames[-1], source)


# --- asynchronous (frontend, orchestrator) --------------------------------------------------------


async def async_send(sock: zmq.asyncio.Socket, message: Message) -> None:
    await sock.send(encode(message))


async def async_recv(sock: zmq.asyncio.Socket, source: str) -> Message | None:
    frames = await sock.recv_multipart()
    return parse(frames[-1], source)
