"""Test-only network guard for server processes (on PYTHONPATH, Python imports it at start-up).

- A TCP/UDP connect or sendto to anything but 127.0.0.0/8 or ::1 fails at once with ENETUNREACH
  ("network unreachable (vlmserve test net guard)") before the real call, and is logged.
- Name lookups answer only names in $VLMSERVE_TEST_HOSTS (name → IP), localhost and numeric
  addresses; any other name fails as unknown, so no DNS query leaves either.
- Before anything else runs, the guard proves itself: connects to 10.0.0.1 (plain socket and asyncio)
  and a lookup of a real-looking name must be refused by the guard, with the real connect swapped for
  a tripwire meanwhile so that even a broken guard sends nothing. The result goes to
  $VLMSERVE_NETGUARD_REPORT; on failure the process exits before serving.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import time

MARK = "vlmserve test net guard"
_LOG = os.environ.get("VLMSERVE_NETGUARD_LOG")
_HOSTS = {k.lower(): v for k, v in json.loads(os.environ.get("VLMSERVE_TEST_HOSTS", "{}")).items()}
_INET = (socket.AF_INET, socket.AF_INET6)

_real = {
    "connect": socket.socket.connect,
    "connect_ex": socket.socket.connect_ex,
    "sendto": socket.socket.sendto,
    "getaddrinfo": socket.getaddrinfo,
}


def _is_loopback(address) -> bool:
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    except ValueError:
        return False  # a name: the OS would resolve it behind our back
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


_quiet = False  # set during the self-test, whose refusals are not traffic the tests should see


def _record(kind: str, target) -> None:
    if _LOG and not _quiet:
        with open(_LOG, "a") as f:
            f.write(json.dumps({"kind": kind, "target": [str(t) for t in target], "pid": os.getpid()}) + "\n")


def _refusal(kind: str, target) -> OSError:
    _record(kind, target)
    return OSError(errno.ENETUNREACH, f"Network is unreachable ({MARK}: {kind} {target!r} refused)")


def connect(self, address):
    if self.family in _INET and not _is_loopback(address):
        raise _refusal("connect", address)
    return _real["connect"](self, address)


def connect_ex(self, address):
    if self.family in _INET and not _is_loopback(address):
        _record("connect", address)
        return errno.ENETUNREACH
    return _real["connect_ex"](self, address)


def sendto(self, data, *args):
    address = args[-1]
    if self.family in _INET and not _is_loopback(address):
        raise _refusal("sendto", address)
    return _real["sendto"](self, data, *args)


def getaddrinfo(host, port, *args, **kwargs):
    if host is not None:
        name = (host.decode() if isinstance(host, bytes) else str(host)).rstrip(".").lower()
        if name in _HOSTS:
            host = _HOSTS[name]
        elif name == "localhost":
            host = "127.0.0.1"
        else:
            try:
                ipaddress.ip_address(name.strip("[]").split("%", 1)[0])
            except ValueError:
                _record("dns", (name, port))
                raise socket.gaierror(socket.EAI_NONAME, f"Name or service not known ({MARK})") from None
    return _real["getaddrinfo"](host, port, *args, **kwargs)


def gethostbyname(name):
    return getaddrinfo(name, None, socket.AF_INET)[0][4][0]


socket.socket.connect = connect
socket.socket.connect_ex = connect_ex
socket.socket.sendto = sendto
socket.getaddrinfo = getaddrinfo
socket.gethostbyname = gethostbyname


def _self_test() -> dict:
    import asyncio

    global _quiet
    _quiet = True
    tripped: list = []

    def tripwire(*args):
        tripped.append(args[1:])
        raise OSError(errno.EHOSTUNREACH, "tripwire: the guard let a connect through")

    saved = dict(_real)
    _real["connect"] = _real["connect_ex"] = _real["sendto"] = tripwire
    report: dict = {"pid": os.getpid()}
    try:
        t0 = time.monotonic()
        try:
            socket.create_connection(("10.0.0.1", 80), timeout=5)
            report["sync"] = "connected"
        except OSError as exc:
            report["sync"] = {"errno": exc.errno, "message": str(exc)}

        async def via_asyncio():
            await asyncio.wait_for(asyncio.open_connection("10.0.0.1", 80), 5)

        try:
            asyncio.run(via_asyncio())
            report["asyncio"] = "connected"
        except OSError as exc:
            report["asyncio"] = {"errno": exc.errno, "message": str(exc)}
        try:
            socket.getaddrinfo("example.com", 80)
            report["dns"] = "resolved"
        except socket.gaierror as exc:
            report["dns"] = {"errno": exc.errno, "message": str(exc)}
        report["seconds"] = time.monotonic() - t0
    finally:
        _real.update(saved)
        _quiet = False
    report["tripped"] = [list(map(str, t)) for t in tripped]
    report["ok"] = (
        not tripped
        and all(
            isinstance(report[k], dict)
            and report[k]["errno"] == errno.ENETUNREACH
            and MARK in report[k]["message"]
            for k in ("sync", "asyncio")
        )
        and isinstance(report["dns"], dict)
        and MARK in report["dns"]["message"]
    )
    return report


if os.environ.get("VLMSERVE_NETGUARD_REPORT"):
    _report = _self_test()
    _path = os.environ["VLMSERVE_NETGUARD_REPORT"]
    # NOTE: the server's child processes (preprocess workers) run this too; the first process, the
    # server itself, owns the main report and each child writes its own beside it.
    try:
        _fd = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        _fd = os.open(f"{_path}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(_fd, "w") as _f:
        json.dump(_report, _f)
    if not _report["ok"]:
        os._exit(70)
