"""CURVE on the internal sockets, over real loopback: only a peer holding the cluster's keys gets a
message through; a stranger without keys, or with a key of its own, gets nothing through."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from common.config import parse_cluster_config
from common.curve import MissingKeys, as_client, cluster_keys, generate_keys, load_keys, secure
from common.transport import bind_random_port, make_socket

WAIT_MS = 1500  # loopback delivers at once; this long with nothing means nothing comes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[zmq.Socket, str, Path]]:
    """A PULL socket of a secured process (as a postproc worker's), and the keys' directory."""
    keys_dir = tmp_path / "keys"
    keys = generate_keys(keys_dir)
    context = zmq.Context()
    authenticator = secure(context, keys)
    pull = make_socket(context, zmq.PULL)
    address = bind_random_port(pull, "127.0.0.1")
    yield pull, address, keys_dir
    pull.close()
    authenticator.stop()
    context.term()


def push_once(address: str, keys_dir: Path | None, own_key: bool = False) -> None:
    context = zmq.Context.instance()
    push = make_socket(context, zmq.PUSH)
    if keys_dir is not None:
        as_client(push, load_keys(keys_dir))
    if own_key:  # a stranger that knows the server's public key but has a keypair of its own
        public, secret = zmq.curve_keypair()
        push.curve_publickey, push.curve_secretkey = public, secret
    push.connect(address)
    push.send(b"hello", zmq.NOBLOCK)
    push.close(linger=WAIT_MS)


def test_only_a_peer_with_the_cluster_keys_gets_through(server, caplog) -> None:
    pull, address, keys_dir = server
    push_once(address, None)  # no CURVE at all: the handshake fails
    assert not pull.poll(WAIT_MS)
    with caplog.at_level(logging.WARNING):
        push_once(address, keys_dir, own_key=True)
        assert not pull.poll(WAIT_MS)
    assert "unknown CURVE key" in caplog.text
    push_once(address, keys_dir)
    assert pull.poll(WAIT_MS) and pull.recv() == b"hello"


def test_keys_are_private_files_and_come_from_the_config_or_the_environment(
    tmp_path: Path,
) -> None:
    keys_dir = tmp_path / "keys"
    keys = generate_keys(keys_dir)
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in keys_dir.iterdir())
    on = parse_cluster_config("")
    assert cluster_keys(on, {"PDCLUSTER_CURVE_KEYS": str(keys_dir)}) == keys
    configured = parse_cluster_config(f"security: {{keys_dir: {keys_dir}}}")
    assert cluster_keys(configured, {}) == keys
    assert cluster_keys(parse_cluster_config("security: {curve: false}"), {}) is None
    with pytest.raises(MissingKeys, match="orchestrator up"):
        cluster_keys(on, {})
