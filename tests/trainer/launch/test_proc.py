"""trainer.launch.proc's process ending, on real processes: each case runs in a child interpreter, so that
``kill_descendants`` never sees the test session's own children (a session's servers)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import REPO

_PRELUDE = """
import json, os, signal, subprocess, sys, threading, time
from trainer.launch.proc import kill_descendants, processes_of
IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
"""


def _run(body: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_process_that_appears_while_ending_gets_its_sigterm():
    """A child started after the first listing (a Ray worker its raylet was starting) is listed again at the next poll
    and gets SIGTERM, its chance to end cleanly, not only the SIGKILL at the end of the grace; one that ignores
    SIGTERM is killed once the grace is over."""
    got = _run(
        """
        first = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])
        # the late child says it was asked to end (our reaping takes the exit codes Popen would read)
        # (SIGTERM blocked until its handler is in place: a SIGTERM during the interpreter's start-up stays pending)
        clean = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: print('term') or sys.exit(3)); "
        clean += "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}); time.sleep(60)"
        block = lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        late = []
        args = dict(stdout=subprocess.PIPE, text=True, preexec_fn=block)
        start = lambda: late.append(subprocess.Popen([sys.executable, "-c", clean], **args))
        threading.Timer(0.3, start).start()
        time.sleep(0.2)
        t0 = time.monotonic()
        left = kill_descendants(2.0, kill_s=3.0)
        s = time.monotonic() - t0
        print(json.dumps({"left": left, "s": s, "late": late[0].stdout.read().split(), "first": first.poll()}))
        """
    )
    # first: gone (reaped here, so Popen reads 0), at the end of the grace
    assert got["left"] == [] and got["late"] == ["term"] and 2.0 <= got["s"] < 5.5, got


def test_a_process_of_the_run_outside_the_tree_is_ended():
    """A process that names the run (its environment: a Ray worker) but is no longer below us (re-parented to init
    after its parent died, no subreaper) is found by ``processes_of`` and ended."""
    got = _run(
        """
        env = {**os.environ, "PPOTUNE_TEST_RUN": "r1"}
        # double fork: the grandchild's parent exits at once, so it is re-parented to init, out of our tree
        spawn = "import subprocess as s, sys; out = dict(stdout=s.DEVNULL, stderr=s.DEVNULL); "
        spawn += "print(s.Popen([sys.executable, '-c', sys.argv[1]], **out).pid)"
        pid = int(subprocess.run([sys.executable, "-c", spawn, IGNORE_TERM], env=env, capture_output=True,
                                 text=True).stdout)
        other = subprocess.Popen([sys.executable, "-c", IGNORE_TERM])  # below us, not of the run
        time.sleep(0.3)
        found = [p.pid for p in processes_of(env=("PPOTUNE_TEST_RUN", "r1"))]
        left = kill_descendants(0.3, kill_s=3.0, also=lambda: processes_of(env=("PPOTUNE_TEST_RUN", "r1")))
        dead = lambda x: not os.path.exists(f"/proc/{x}") or open(f"/proc/{x}/stat").read().split()[2] == "Z"
        gone = [dead(pid), dead(other.pid)]
        print(json.dumps({"found": found, "pid": pid, "left": left, "gone": gone}))
        """
    )
    assert got["found"] == [got["pid"]] and got["left"] == [] and got["gone"] == [True, True], got


def test_processes_of_reads_the_command_line_and_the_open_files(tmp_path):
    """A Ray daemon names its session's folder on its command line; an agent (``ray::DashboardAgent``) rewrote its
    command line and environment but keeps its log open there."""
    got = _run(
        f"""
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--temp-dir={tmp_path}/ray"])
        log = "import time; f = open('{tmp_path}/ray/agent.log', 'w'); time.sleep(60)"
        os.makedirs("{tmp_path}/ray")
        q = subprocess.Popen([sys.executable, "-c", log])
        deadline = time.monotonic() + 20  # until the log is open (an interpreter's start-up on a loaded machine)
        while not os.path.exists("{tmp_path}/ray/agent.log") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        found = sorted(x.pid for x in processes_of(text="{tmp_path}/ray"))
        none = processes_of(text="{tmp_path}/other")
        p.kill(), q.kill(), p.wait(), q.wait()
        print(json.dumps({{"found": found, "pids": sorted([p.pid, q.pid]), "none": len(none)}}))
        """
    )
    assert got["found"] == got["pids"] and got["none"] == 0, got
