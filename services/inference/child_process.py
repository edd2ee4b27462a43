"""Child processes of the service that share its host arena: the fetch worker (fetch_worker.py)
and the engine process (engine_process.py).

Each is ``python -m MODULE CONN_FD ARENA_FD ARENA_BYTES [ARGS...]``: it inherits one end of a
socketpair (a multiprocessing Connection) and a duplicate of the arena's memfd, which it maps.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from services.inference.arena import HostArena

_REPO = Path(__file__).resolve().parents[2]


def spawn(module: str, arena: HostArena, *args: str) -> tuple[subprocess.Popen, Connection]:
    """Start ``module`` as a child sharing ``arena``; returns it and the service's end of the
    connection."""
    parent, child = socket.socketpair()
    arena_fd = os.dup(arena.fd)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", module,
                str(child.fileno()), str(arena_fd), str(arena.capacity), *args,
            ],
            pass_fds=(arena_fd, child.fileno()),
            env=env,
        )  # fmt: skip
    except BaseException:
        parent.close()
        raise
    finally:
        os.close(arena_fd)
        child.close()
    return proc, Connection(parent.detach())
