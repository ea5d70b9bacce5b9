"""``ppotune storage-proxy`` keeps the study on this host unless told otherwise: Optuna's gRPC proxy has no TLS and no
authentication, and its client takes no credentials, so the proxy listens on 127.0.0.1 by default and, when
``--host`` widens it, says that the study is open to that network. Real proxies in front of the session's
throwaway PostgreSQL server (tests/pg.py); without one these skip, saying why."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys

import psutil
import pytest

from support import REPO, wait_until
from tuner.study.proxy import exposure_warning


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_is_not_a_warning(host):
    assert exposure_warning(host, 13000) is None


@pytest.mark.parametrize(
    ("host", "where"), [("0.0.0.0", "every network this host is on"), ("10.1.2.3", "the network of 10.1.2.3")]
)
def test_a_wider_address_is(host, where):
    text = exposure_warning(host, 13000)
    assert text.startswith(f"the study is open to {where} on port 13000: Optuna's gRPC proxy has no TLS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int, port: int) -> list:
    """The addresses the process listens on at ``port`` (gRPC binds dual-stack: 127.0.0.1 shows as
    ::ffff:127.0.0.1, 0.0.0.0 as ::)."""
    out = []
    for c in psutil.Process(pid).net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            ip = ipaddress.ip_address(c.laddr.ip)
            out.append(getattr(ip, "ipv4_mapped", None) or ip)
    return out


def _start(url: str, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tuner.cli", "storage-proxy", "--storage", url, "--port", str(port), *extra],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("extra", [[], ["--host", "0.0.0.0"]], ids=["default", "widened"])
def test_the_proxy_listens_where_it_says_and_warns_when_widened(pg_url, extra):
    port = _free_port()
    p = _start(pg_url, port, *extra)
    try:
        line = p.stdout.readline()
        host = extra[1] if extra else "127.0.0.1"
        assert line.startswith("ppotune storage-proxy: serving") and line.strip().endswith(f"grpc://{host}:{port}")
        assert wait_until(lambda: _listening(p.pid, port), 20)
        (ip,) = _listening(p.pid, port)
        assert ip.is_unspecified if extra else ip.is_loopback, ip
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    warned = [ln for ln in err.splitlines() if ln.startswith("ppotune storage-proxy: warning: the study is open to")]
    assert len(warned) == (1 if extra else 0), err
