"""ZeroMQ CURVE on every internal socket: only processes holding the cluster's key take part.

Without it, any local process (any pod, in Kubernetes) could register as a worker, read other
users' prompts, forge aborts and chunks into their streams, or take over `gen-0`'s identity.
One keypair per cluster, known to all of its processes:

    orchestrator up ──▶ generate_keys(private dir, 0700; files 0600) ──▶ PDCLUSTER_CURVE_KEYS
    every process   ──▶ secure(context, keys): its sockets encrypt, authenticate the peer as
                        the cluster's server key, and its binding sockets (serve()) accept only
                        clients presenting the cluster's key, checked by a ZAP handler
    Kubernetes      ──▶ a Secret with the two files, mounted at `security.keys_dir`

A stranger's handshake fails before any byte reaches the application; one with a key of its
own is refused by the ZAP handler, with a log line. The KV data itself moves over UCX, which
CURVE does not cover: keep `internal_host` on a network only the cluster reaches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator

from common.config import ClusterConfig

logger = logging.getLogger(__name__)

KEYS_ENV = "PDCLUSTER_CURVE_KEYS"  # the keys directory `orchestrator up` gives its children
PUBLIC_FILE = "cluster.key"
SECRET_FILE = "cluster.key_secret"


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes


class MissingKeys(RuntimeError):
    """CURVE is on (`security.curve`) but no keys were given."""


def generate_keys(directory: Path) -> ClusterKeys:
    """A new keypair in `directory` (created 0700; the files 0600, written before filled)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    public, secret = zmq.curve_keypair()
    for name, key in ((PUBLIC_FILE, public), (SECRET_FILE, secret)):
        path = directory / name
        path.touch(mode=0o600)
        path.write_bytes(key)
    return ClusterKeys(public, secret)


def load_keys(directory: Path) -> ClusterKeys:
    try:
        public = (directory / PUBLIC_FILE).read_bytes().strip()
        secret = (directory / SECRET_FILE).read_bytes().strip()
    except OSError as e:
        raise MissingKeys(f"cannot read the cluster's CURVE keys in {directory}: {e}") from None
    if len(public) != 40 or len(secret) != 40:
        raise MissingKeys(f"{directory}: the CURVE keys must be 40 z85 characters each")
    return ClusterKeys(public, secret)


def cluster_keys(config: ClusterConfig, environ: Mapping[str, str]) -> ClusterKeys | None:
    """The keys a process uses (entry points only): `security.keys_dir`, else what `orchestrator
    up` passed; None when `security.curve` is off."""
    if not config.security.curve:
        return None
    directory = config.security.keys_dir or environ.get(KEYS_ENV)
    if not directory:
        raise MissingKeys(
            "security.curve is on but no keys were given: start the cluster with "
            "`orchestrator up`, or set security.keys_dir (a Kubernetes Secret)"
        )
    return load_keys(Path(directory))


class _ClusterKeyOnly:
    """The ZAP check: a client must present the cluster's own public key."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.public:
            return True
        logger.warning("refused a connection with an unknown CURVE key %s...", key[:8].decode())
        return False


def secure(context: zmq.Context[Any], keys: ClusterKeys) -> Authenticator:
    """Every socket made from `context` from now on speaks CURVE with the cluster's keys; binding
    sockets must also call serve(). Returns the running ZAP handler (stop it before the
    context is terminated)."""
    if isinstance(context, zmq.asyncio.Context):
        authenticator: Authenticator = AsyncioAuthenticator(context)
    else:
        authenticator = ThreadAuthenticator(context)
    authenticator.start()  # before the defaults below: its own inproc socket stays plain
    authenticator.configure_curve_callback("*", _ClusterKeyOnly(keys.public))
    context.curve_publickey = keys.public
    context.curve_secretkey = keys.secret
    context.curve_serverkey = keys.public
    return authenticator


def as_client(sock: zmq.Socket[Any], keys: ClusterKeys | None) -> None:
    """One socket of a context that secure() was not called on (the CLI's queries)."""
    if keys is not None:
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
        sock.curve_serverkey = keys.public


def serve(sock: zmq.Socket[Any]) -> None:
    """Before a socket binds: it is the CURVE server of its connections (if CURVE is on)."""
    if sock.getsockopt(zmq.MECHANISM) == zmq.CURVE:
        sock.curve_server = True
