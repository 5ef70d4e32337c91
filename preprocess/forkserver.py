"""The process's one forkserver, preloaded with what every pool's workers import.

A forkserver is per process: the first pool that starts it fixes what it has imported, and later
``set_forkserver_preload`` calls are ignored. So pool modules register their workers' modules when they are
imported (before any pool starts), and whichever pool starts the server first preloads them all: every worker,
and every restart after a crash, forks with torch already imported instead of importing it again (~4 s of CPU
on a 2-core EPYC).
"""

from __future__ import annotations

import multiprocessing as mp
import threading

_lock = threading.Lock()
_modules: list[str] = []


def register(modules: list[str]) -> None:
    """Add ``modules`` to what the forkserver imports when it starts (a module named after it started is
    imported by each worker instead)."""
    with _lock:
        _modules.extend(m for m in modules if m not in _modules)


def context() -> mp.context.ForkServerContext:
    """The forkserver context, preloading everything registered so far."""
    ctx = mp.get_context("forkserver")
    with _lock:
        ctx.set_forkserver_preload(list(_modules))
    return ctx
