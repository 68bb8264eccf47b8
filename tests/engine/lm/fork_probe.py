"""Imported by the fork server in tests/engine/lm/test_fork_server.py: records which process imported it."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

IMPORTED_IN = os.getpid()


def report(conn: Connection, name: str) -> None:
    """Send (the importing pid, this pid, the parent's pid, the variable ``name``) back over ``conn``."""
    conn.send((IMPORTED_IN, os.getpid(), os.getppid(), os.environ.get(name)))
    conn.close()
