"""Where the processes of a run listen: the rendezvous stores and the process group's own sockets.

c10d's `TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says: the host
name only tells clients where to connect. A store is an unauthenticated key-value server, so a run binds
its listening socket itself and hands it to the store (`master_listen_fd`): on one node to the loopback
address, on several nodes to the address the other nodes reach this one at. torchrun's c10d rendezvous
creates two such stores (the rendezvous's and the workers' MASTER_ADDR:MASTER_PORT), so runs use the
`liandan-c10d` rendezvous backend: torchrun's own, with both stores bound this way. Gloo and NCCL listen
on the interface that $GLOO_SOCKET_IFNAME and $NCCL_SOCKET_IFNAME name; on one node that is loopback.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import socket
import sys
from pathlib import Path

LOOPBACK = "127.0.0.1"
RENDEZVOUS_BACKEND = "liandan-c10d"
DEFAULT_RDZV_PORT = 29400  # torchrun's
IFF_LOOPBACK = 0x8


def loopback_interface() -> str:
    """The name of the loopback network interface (Linux: the one flagged IFF_LOOPBACK; else "lo")."""
    with contextlib.suppress(OSError):
        for device in sorted(Path("/sys/class/net").iterdir()):
            with contextlib.suppress(OSError, ValueError):
                if int((device / "flags").read_text(), 16) & IFF_LOOPBACK:
                    return device.name
    return "lo"


def single_node_env() -> dict[str, str]:
    """Environment that keeps the process group's own listening sockets (gloo's pairs, NCCL's bootstrap)
    on the loopback interface; a value the user set already wins."""
    interface = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface}


def is_loopback(host: str, resolve: bool = False) -> bool:
    """Whether `host` is a loopback address ("localhost" counts); with `resolve`, a name is looked up first."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host) if resolve else host).is_loopback
    except (OSError, ValueError):
        return False


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of a rendezvous endpoint "host[:port]" (torchrun's parsing, its default port)."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_RDZV_PORT)


def route_address(host: str, port: int = DEFAULT_RDZV_PORT) -> str:
    """This machine's address on the way to `host`: where the other nodes of a run reach this one."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on `host`'s address only (OSError when that address is not this machine's or
    the port is taken)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(host: str, port: int = 0, *, multi_tenant: bool = False,
                timeout: datetime.timedelta = datetime.timedelta(seconds=300)):  # fmt: skip
    """A c10d TCPStore server that listens on `host`'s address only (port 0: any free port; `.port` says
    which)."""
    import torch.distributed as dist

    sock = listening_socket(host, port)
    if not sys.platform.startswith("linux"):  # master_listen_fd is Linux-only: the best c10d offers elsewhere
        bound = sock.getsockname()[1]
        sock.close()
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant,
                             timeout=timeout)  # fmt: skip
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here and closes it
    try:
        return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant,
                             timeout=timeout, master_listen_fd=fd, use_libuv=True)  # fmt: skip
    except BaseException:
        with contextlib.suppress(OSError):
            socket.close(fd)
        raise


def _host_or_join(host: str, port: int, timeout: datetime.timedelta):
    """The rendezvous store: hosted here, bound to the endpoint's address, when that address is this
    machine's and the port is free; else a client of whoever hosts it."""
    import torch.distributed as dist

    try:
        return bound_store(host, port, multi_tenant=True, timeout=timeout)
    except OSError as err:
        if err.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            raise
    return dist.TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)


def _create_handler(params):
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

    class BoundWorkerStore(DynamicRendezvousHandler):
        """torchrun's handler, with the workers' store (MASTER_ADDR:MASTER_PORT) bound to this node's
        address (torchrun's --local-addr) rather than every interface."""

        def _create_tcp_store_server(self, master_addr, master_port):
            return bound_store(master_addr, master_port, multi_tenant=True)

        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

    host, port = parse_endpoint(params.endpoint)
    timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60))
    store = _host_or_join(host, port, timeout)
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = BoundWorkerStore  # the same object, one method different
    return handler


def register_rendezvous() -> None:
    """Make `--rdzv-backend=liandan-c10d` known to torchrun in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    registry.register(RENDEZVOUS_BACKEND, _create_handler)  # the same creator again is no error
