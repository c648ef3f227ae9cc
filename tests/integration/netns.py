"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, for tests that
need the cluster's processes on different addresses with real TCP between them and a link that
can be cut. (The namespaces still share one kernel and its memory: a test keeps transports that
use that, like UCX's shared memory and CMA, out itself.)

    namespace <run>-net:     br0 ─┬─ v-<host 0> ─┬─ v-<host 1> ─┬─ ...     (the switch)
                                  │               │               │
    namespace <run>-<host 0>: eth0 10.213.0.2     │               │        (lo up in each too)
    namespace <run>-<host 1>:                eth0 10.213.0.3      │
    ...                                                          ...

`<run>` is `pdcnet-<pid of the test process>`. The addresses exist only inside the namespaces
this run creates (the bridge has a namespace of its own, none of it touches the machine's own
network), so they collide neither with the machine's networks nor with another run's. A run
that crashed leaves namespaces named for a pid that is gone: the next run deletes them (and
ends the processes still in them) first.

A partition sets the host's port on the bridge down: like a pulled cable, the host's own
interface keeps its address and route, so neither side gets a local error, only silence.
Needs root; without it (or where `ip netns add` is refused) the tests using it skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PREFIX = "pdcnet-"
SUBNET = "10.213.0"  # /24; host k gets .k+2 (.1 is left for a gateway no test needs)
HOST_DEVICE = "eth0"  # the host's end of its link, as on a real machine
CLONE_NEWNET = 0x40000000  # <sched.h>
IP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # the test's name for it: "orch", "gen0", ...
    namespace: str
    address: str
    port: str  # its link's end on the bridge (in the bridge's namespace)


def ip(*args: str, namespace: str | None = None, check: bool = True) -> str:
    """One `ip` command (inside `namespace` if given); its stdout."""
    argv = ["ip", *(("-n", namespace) if namespace else ()), *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


class NetnsBed:
    """Namespaces for `host_names`, each with one address on a shared bridge; delete() undoes it."""

    def __init__(self, host_names: list[str]) -> None:
        self.run_name = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.run_name}-net"
        self.hosts = {
            name: Host(name, f"{self.run_name}-{name}", f"{SUBNET}.{k + 2}", f"v-{name}"[:15])
            for k, name in enumerate(host_names)
        }
        self.created: list[str] = []  # namespaces, in creation order

    def create(self) -> None:
        self._add_namespace(self.bridge)
        ip("link", "add", "br0", "type", "bridge", namespace=self.bridge)
        ip("link", "set", "br0", "up", namespace=self.bridge)
        for host in self.hosts.values():
            self._add_namespace(host.namespace)
            # the pair is made in the bridge's namespace, its other end born in the host's
            ip("link", "add", host.port, "type", "veth", "peer", "name", HOST_DEVICE,
               "netns", host.namespace, namespace=self.bridge)  # fmt: skip
            ip("link", "set", host.port, "master", "br0", "up", namespace=self.bridge)
            ip("addr", "add", f"{host.address}/24", "dev", HOST_DEVICE, namespace=host.namespace)
            ip("link", "set", HOST_DEVICE, "up", namespace=host.namespace)

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.created.append(name)
        ip("link", "set", "lo", "up", namespace=name)

    def address(self, host: str) -> str:
        return self.hosts[host].address

    def command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` to run inside `host`'s namespace (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def link_down(self, host: str) -> None:
        """Cut `host` off from every other host (its bridge port down); see the module doc."""
        ip("link", "set", self.hosts[host].port, "down", namespace=self.bridge)

    def link_up(self, host: str) -> None:
        ip("link", "set", self.hosts[host].port, "up", namespace=self.bridge)

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """Run the calling thread (and the threads it starts meanwhile) in `host`'s namespace:
        sockets made here belong to that host, so the test itself is its client."""
        libc = ctypes.CDLL(None, use_errno=True)
        with (
            open("/proc/thread-self/ns/net") as own,
            open(f"/run/netns/{self.hosts[host].namespace}") as target,
        ):
            _setns(libc, target.fileno())
            try:
                yield
            finally:
                _setns(libc, own.fileno())

    def delete(self) -> None:
        """End whatever still runs in the namespaces, then delete them; never raises."""
        for namespace in reversed(self.created):
            _delete_namespace(namespace)
        self.created.clear()


def _setns(libc: ctypes.CDLL, fd: int) -> None:
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _delete_namespace(namespace: str) -> None:
    pids = ip("netns", "pids", namespace, check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", namespace, check=False)


def delete_leftovers() -> list[str]:
    """Delete the namespaces of earlier runs whose test process is gone; their names."""
    gone = []
    for line in ip("netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _delete_namespace(name)
            gone.append(name)
    return gone


def skip_reason() -> str | None:
    """Why this machine cannot host a test bed, or None."""
    if os.geteuid() != 0:
        return "the multi-host test bed needs root, for network namespaces"
    if shutil.which("ip") is None:
        return "the multi-host test bed needs `ip` (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    if result.returncode != 0:
        return (
            f"the multi-host test bed needs `ip netns add`, refused here: {result.stderr.strip()}"
        )
    ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def netns_bed(host_names: list[str]) -> Iterator[NetnsBed]:
    """A test bed for the block; deleted on the way out, whatever happened. Skips the test
    (with the reason) where namespaces cannot be made."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    delete_leftovers()
    bed = NetnsBed(host_names)
    try:
        bed.create()
        yield bed
    finally:
        bed.delete()
