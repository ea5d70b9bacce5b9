"""The plumbing of a side-by-side benchmark (bench_step_overhead.py, bench_pass_memory.py): one worker process per
side (each in its own interpreter: ours, verl's venv), asked one JSON request at a time on its stdin, answering on
marked lines of its stdout (any other line is the engines' own output, passed on to stderr); and the JSON record of a
run. Standard library only: imported by the parent and by the workers, in either environment."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Iterator

__all__ = ["WorkerProcess", "answer", "requests", "write_record"]

_MARK = "@@bench "  # a worker's answers; any other line is the engines' own output


def answer(obj: dict) -> None:
    """A worker's answer to the parent."""
    sys.stdout.write(_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def requests() -> Iterator[dict]:
    """A worker's requests, until the parent says stop."""
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("stop"):
            return
        yield ask


class WorkerProcess:
    """One side's worker, started with ``cmd`` and ``env``; it answers once when ready."""

    def __init__(self, side: str, cmd: list[str], env: dict) -> None:
        self.side = side
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.read()

    def read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.side} worker ended (exit {self.proc.wait()})")
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK) :])
            sys.stderr.write(f"[{self.side}] {line}")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=120)


def write_record(path: Path, **fields) -> None:
    """The run's JSON record: its date, the machine, the command, then ``fields``."""
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "command": " ".join(sys.argv),
        **fields,
    }
    path.write_text(json.dumps(record, indent=1))
