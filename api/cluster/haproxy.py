"""The load balancer of `vlmserve cluster`: HAProxy's config from our template, and its admin socket.

HAProxy does the proxying (health checks, retries, draining); the only code of ours it runs is route.lua, which
picks each request's replica (rendezvous hashing of its key with bounded load, or the least-loaded replica). See
haproxy.cfg.in for the settings and why.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from string import Template

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "haproxy.cfg.in"
LUA = HERE / "route.lua"
BACKEND = "vlmserve_replicas"
MIN_VERSION = (2, 6)  # the oldest tested (Debian 12's); route.lua needs its Lua API and xxh3 converter

# NOTE: 32 KiB of base64 is 24 KiB of image bytes: past a PNG's or JPEG's headers (which many images share)
# and into pixel data. The window must hold the headers, whatever precedes the image in the body, and this.
DEFAULT_KEY_CHARS = 32768
DEFAULT_BUFSIZE = 65536
ROUTINGS = ("image", "round-robin")


class HAProxyMissing(RuntimeError):
    pass


def find_haproxy() -> str:
    """Path of an HAProxy >= 2.6 binary built with Lua, or HAProxyMissing saying how to get one."""
    how = "bin/setup installs it (as root: apt-get install haproxy)"
    path = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise HAProxyMissing(f"vlmserve cluster needs HAProxy {'.'.join(map(str, MIN_VERSION))}+; {how}")
    out = subprocess.run([path, "-vv"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"version (\d+)\.(\d+)", out)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if version < MIN_VERSION or "USE_LUA=1" not in out and "+LUA" not in out:
        raise HAProxyMissing(
            f"{path} is HAProxy {'.'.join(map(str, version))}{'' if '+LUA' in out else ' without Lua'}; "
            f"vlmserve cluster needs {'.'.join(map(str, MIN_VERSION))}+ with Lua; {how}"
        )
    return path


@dataclass(slots=True)
class BalancerConfig:
    bind: str  # "127.0.0.1:8000"
    replicas: list[tuple[str, str]]  # (name, "host:port"), in a fixed order: the order gives server ids
    admin_socket: str
    lua_path: str = str(LUA)
    key_chars: int = DEFAULT_KEY_CHARS
    bufsize: int = DEFAULT_BUFSIZE
    balance_factor: int = (
        150  # a replica over max(balance_min_load, this % of the mean load) takes no new key
    )
    balance_min_load: int = 8
    check_inter_ms: int = 500
    check_fastinter_ms: int = 250
    drain_timeout_s: int = 120
    maxconn: int = 2000
    routing: str = "image"  # or "round-robin": the baseline the benchmark compares against

    def render(self) -> str:
        if self.key_chars + 4096 > self.bufsize:
            raise ValueError("bufsize must leave room for the headers and the image key (key_chars + 4096)")
        if self.balance_factor < 100 or self.balance_min_load < 1:
            raise ValueError("balance_factor must be >= 100 (%) and balance_min_load >= 1")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        servers = "\n".join(
            f"    server {name} {addr} id {i + 1}" for i, (name, addr) in enumerate(self.replicas)
        )
        fields = {f: getattr(self, f) for f in self.__slots__ if f not in ("replicas", "routing")}
        if self.routing == "image":
            rules = {
                "route_rule": f"http-request lua.vlmserve_route {BACKEND} {self.key_chars} "
                f"{self.balance_factor} {self.balance_min_load}",
                "balance": "leastconn",
                "use_server": "use-server %[var(txn.vlmserve_pick)] if { var(txn.vlmserve_pick) -m found }",
            }
        else:
            rules = {
                "route_rule": "http-request set-var(txn.vlmserve_route) str(round-robin)",
                "balance": "roundrobin",
                "use_server": "# round-robin: every request to the next replica in turn",
            }
        return Template(TEMPLATE.read_text()).substitute(fields, servers=servers, **rules)


@dataclass(slots=True)
class ServerState:
    name: str
    status: str  # "UP", "DOWN", "UP 1/2", "DOWN 1/2", "MAINT", "DRAIN", "no check"
    current: int  # requests in flight (HAProxy's scur)
    total: int  # requests sent to it since start (stot)
    check: str  # last check's result, e.g. "L7OK", "L4CON"

    @property
    def up(self) -> bool:
        return self.status.startswith("UP") or self.status == "no check"


class AdminSocket:
    """HAProxy's runtime API on its stats socket (one command per connection)."""

    def __init__(self, path: str | Path, timeout_s: float = 5.0) -> None:
        self.path = str(path)
        self.timeout_s = timeout_s

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout_s)
            s.connect(self.path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
        return b"".join(chunks).decode()

    def servers(self) -> dict[str, ServerState]:
        text = self.command("show stat").lstrip("# ")
        out = {}
        for row in csv.DictReader(text.splitlines()):
            if row["pxname"] != BACKEND or row["svname"] in ("FRONTEND", "BACKEND"):
                continue
            out[row["svname"]] = ServerState(
                row["svname"],
                row["status"],
                int(row["scur"] or 0),
                int(row["stot"] or 0),
                row["check_status"],
            )
        return out

    def set_health_checks(self, server: str, enabled: bool) -> None:
        self._ok(f"{'enable' if enabled else 'disable'} health {BACKEND}/{server}")

    def _ok(self, line: str) -> None:
        reply = self.command(line).strip()
        if reply:
            raise RuntimeError(f"HAProxy refused {line!r}: {reply}")
