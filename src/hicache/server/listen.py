"""The server's HTTP socket, bound before the model loads and handed to uvicorn.

Binding first keeps the port: nothing can take it between the check and the serving, and
a connection made while the engine starts waits in the backlog.
"""

from __future__ import annotations

import socket

from hicache.server.args import FlagError

__all__ = ["LISTEN_BACKLOG", "listen_on"]


LISTEN_BACKLOG = 2048
"""The HTTP socket's backlog (uvicorn's default)."""


def listen_on(host: str, port: int, port_flag: str = "--port") -> socket.socket:
    """The server's HTTP socket, listening on ``host:port`` from now on (before the model
    loads; uvicorn serves it once the engine has started: a connection made meanwhile
    waits in the backlog). Checked and bound at once, and kept: nothing can take the port
    between the check and the serving. :class:`FlagError` naming ``--host`` or
    ``port_flag`` for an address the server cannot listen on (does not resolve, in use, or
    not local)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FlagError("--host", host, f"cannot be resolved ({exc.strerror or exc})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise FlagError(
            port_flag, port, f"cannot listen on {host}:{port} ({exc.strerror or exc})"
        ) from None
    sock.set_inheritable(True)
    return sock
