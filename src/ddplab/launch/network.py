"""Which address and interface this node uses to reach the others, worked out instead of asked for.

A multi-node torchrun needs the node's address (`--local-addr`), whether it hosts the store (`is_host`)
and gloo's interface (`GLOO_SOCKET_IFNAME`); by default they follow a hostname that often resolves to
127.0.0.1, and the job hangs at init. The route to the rendezvous endpoint gives all three, sending nothing."""

import fcntl
import socket
import struct

from ..errors import LaunchError

_SIOCGIFADDR = 0x8915


def split_endpoint(endpoint: str, default_port: int = 29400) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
    if not port:
        return endpoint, default_port
    if not port.isdigit():
        raise LaunchError(
            f"rendezvous endpoint '{endpoint}' has no valid port", "write it as HOST:PORT, e.g. 10.0.0.1:29500"
        )
    return host.strip("[]"), int(port)


def resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        raise LaunchError(
            f"cannot resolve the rendezvous host '{host}'",
            "check the spelling, or give node 0's IP address in --rdzv-endpoint / --master-addr",
        ) from None


def source_address_for(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((resolve(host), port))
        except OSError as e:
            raise LaunchError(
                f"no route from this node to {host}:{port} ({e.strerror})",
                "check that node 0's address is reachable from here (ip route get ADDRESS)",
            ) from None
        return s.getsockname()[0]


def is_local_address(host: str) -> bool:
    """True when `host` names one of this machine's own addresses (so this node hosts the store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((resolve(host), 0))
            return True
        except OSError:
            return False


def interface_with_address(address: str) -> str | None:
    """The name of the interface that holds IPv4 `address` (e.g. 'eth0'), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                # an interface without an IPv4 address
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None
