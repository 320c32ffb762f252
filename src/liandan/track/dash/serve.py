"""`liandan dash`'s server: uvicorn on a socket bound here (port 0 picks a free one, and the URL printed names
the port the system gave), loopback unless told otherwise, and then only with a token."""

from __future__ import annotations

import errno
import ipaddress
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from liandan.config import ConfigError


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback one (a name is resolved)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError as err:
        raise ConfigError(f"cannot resolve --host {host!r}: {err}") from None
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use (another dashboard?): name another with"
                              " --port, or --port 0 for a free one") from None  # fmt: skip
        if err.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"cannot listen on {host}: no interface of this machine has that address") from None
        raise
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(project: Path | str, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          say: Callable[[str], None] = print) -> None:  # fmt: skip
    """Serve the dashboard of the runs under `project` until interrupted."""
    import uvicorn

    from liandan.track.dash.api import ApiError, Dashboard
    from liandan.track.dash.app import create_app
    from liandan.track.store import StoreError

    project = Path(project)
    if not project.is_dir():
        raise ConfigError(f"no project directory {project} (the directory that holds the run directories)")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be from 0 to 65535, not {port}")
    if token is not None and len(token) < 8:
        raise ConfigError("--token must be at least 8 characters")
    loopback = is_loopback(host)
    if not loopback and token is None:
        token = secrets.token_urlsafe(24)
        say(f"dash: bound to {host}, not a loopback address: every API request needs the token {token}")
    try:
        dash = Dashboard(project)
    except (StoreError, ApiError) as err:
        raise ConfigError(f"cannot open the run store of {project}: {err}") from None
    app = create_app(dash, token, loopback=loopback)
    sock = bind(host, port)
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/" + (f"?token={token}" if token else "")
    say(f"dash: {len(dash.runs())} run(s) of {dash.project}")
    say(f"dash: open {url}")
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5)
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        dash.close()
