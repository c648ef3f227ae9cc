"""Where UCX (the NIXL backend moving KV blocks) may listen: the internal host's interface only,
and ports inside the cluster's range.

Left alone, UCX's TCP transport listens on every interface (the external one included) on random
ports and advertises them in the NIXL metadata. UCX reads its settings from the environment when
an agent is created, so an engine worker sets these first:

    internal_host 127.0.0.1   ──▶ UCX_NET_DEVICES=lo          (the interface holding that address)
    internal_host 0.0.0.0     ──▶ no restriction (a pod: its network is the cluster's)
    port_range [low, high]    ──▶ UCX_TCP_PORT_RANGE=low-high
"""

from __future__ import annotations

import fcntl
import socket
import struct

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (Linux), None if none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def ucx_environment(internal_host: str, port_range: tuple[int, int] | None) -> dict[str, str]:
    """The UCX settings that keep its listeners on the internal network and in the range."""
    env: dict[str, str] = {}
    host = "127.0.0.1" if internal_host == "localhost" else internal_host
    if host not in ("0.0.0.0", "", "*"):
        device = interface_of(host)
        if device is None:
            raise ValueError(f"internal_host {internal_host!r} is no address of this machine")
        env["UCX_NET_DEVICES"] = device
    if port_range is not None:
        env["UCX_TCP_PORT_RANGE"] = f"{port_range[0]}-{port_range[1]}"
    return env
