"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` + ``pg_ctl`` in a temp dir.

Debian's ``postgresql`` package (``scripts/install_test_deps.sh`` installs it) ships the server
binaries in ``/usr/lib/postgresql/<major>/bin``. PostgreSQL refuses to run as root, so when this
process is root the cluster belongs to an unprivileged user (``postgres`` if the package created
it, else ``nobody``). The server listens on 127.0.0.1 only, on a free port, with password
(scram-sha-256) authentication, so a wrong password is refused as it would be on a real server.

    with ThrowawayPostgres() as pg:
        url = pg.url(pg.create_database("study"))   # postgresql://ppotune:<password>@127.0.0.1:<port>/study
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = ["ThrowawayPostgres", "PostgresUnavailable", "find_bindir"]

USER = "ppotune"


class PostgresUnavailable(RuntimeError):
    """No server binaries (or no driver): the caller skips with this reason."""


def find_bindir() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl`` (newest Debian major first, then PATH)."""
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if Path(d, "initdb").is_file() and Path(d, "pg_ctl").is_file():
            return Path(d)
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    status = Path(__file__).resolve().parents[1] / ".test_deps" / "postgres.status"
    why = status.read_text().strip() if status.is_file() else "run scripts/install_test_deps.sh"
    raise PostgresUnavailable(f"PostgreSQL server binaries (initdb, pg_ctl) not found ({why})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> Optional[str]:
    """The unprivileged user the server runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            pass
    raise PostgresUnavailable("running as root and neither a 'postgres' nor a 'nobody' user exists")


class ThrowawayPostgres:
    """A PostgreSQL cluster in a temp dir, stopped and deleted by :meth:`stop` (or the ``with`` block).

    ``durable=False`` (tests) turns fsync and synchronous commit off; a benchmark keeps the defaults.
    """

    def __init__(self, *, durable: bool = False, max_connections: int = 200):
        self.bindir = find_bindir()
        self.password = secrets.token_hex(12)
        self.port = _free_port()
        self.user = _run_as()
        self.durable = durable
        self.max_connections = max_connections
        self.root = Path(tempfile.mkdtemp(prefix="ppotune-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._started = False

    # ---- lifecycle
    def _cmd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kw = {"user": self.user} if self.user else {}
        r = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            **kw,
        )
        if r.returncode != 0:
            tail = self.log.read_text()[-2000:] if self.log.is_file() else ""
            raise RuntimeError(f"{args[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}\n{tail}")
        return r

    def start(self) -> "ThrowawayPostgres":
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self.user:
            os.chmod(self.root, 0o755)
            p = pwd.getpwnam(self.user)
            os.chown(self.root, p.pw_uid, p.pw_gid)
            os.chown(pwfile, p.pw_uid, p.pw_gid)
        self._cmd(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            USER,
            "--pwfile",
            str(pwfile),
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--no-locale",
            "--no-instructions",
        )
        pwfile.unlink()
        opts = [
            "listen_addresses=127.0.0.1",
            f"port={self.port}",
            f"unix_socket_directories={self.root}",
            f"max_connections={self.max_connections}",
        ]
        if not self.durable:
            opts += ["fsync=off", "synchronous_commit=off", "full_page_writes=off"]
        self._cmd(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-o",
            " ".join(f"-c {o}" for o in opts),
            "start",
        )
        self._started = True
        return self

    def stop(self) -> None:
        if self._started:
            try:
                self._cmd("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
            except Exception:  # noqa: BLE001 - already gone: the directory still goes
                pass
            self._started = False
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "ThrowawayPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- use
    def url(self, database: str = "postgres", *, password: Optional[str] = None) -> str:
        pw = self.password if password is None else password
        return f"postgresql://{USER}:{pw}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> list[tuple]:
        """Run one statement as the superuser (autocommit); the rows it returns."""
        try:
            import psycopg
        except ImportError as e:  # pragma: no cover - the dev extra installs it
            raise PostgresUnavailable(f"psycopg not installed ({e}); pip install -e '.[dev]'") from None
        conn = psycopg.connect(
            host="127.0.0.1", port=self.port, user=USER, password=self.password, dbname=database, autocommit=True
        )
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def create_database(self, name: Optional[str] = None) -> str:
        name = name or f"t_{secrets.token_hex(4)}"
        self.sql(f'CREATE DATABASE "{name}"')
        return name

    def connections(self, database: str) -> int:
        """Client connections to ``database`` now (this query's own connection goes to another database)."""
        return int(self.sql(f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}'")[0][0])

    def wait_connections(self, database: str, at_most: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        n = self.connections(database)
        while n > at_most and time.monotonic() < deadline:
            time.sleep(0.2)
            n = self.connections(database)
        return n
