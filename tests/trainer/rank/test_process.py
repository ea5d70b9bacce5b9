"""A rank's status file says why the rank failed, even when the launcher stops it while it records that."""

import json
import subprocess
import sys
import textwrap

from trainer.contracts import ExitCode

# The launcher's SIGTERM lands while the rank records its own OOM: a dict that signals the process the moment
# fail_rank sets the status makes the race deterministic.
_RACE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from trainer.rank.process import fail_rank, new_state, on_sigterm_write

    class Racing(dict):
        def __setitem__(self, key, value):
            super().__setitem__(key, value)
            if key == "status":
                os.kill(os.getpid(), signal.SIGTERM)

    state = Racing(new_state())
    rank_file = Path(sys.argv[1])
    on_sigterm_write({"state": state, "rank_file": rank_file})
    fail_rank(MemoryError("can't allocate memory"), 0, rank_file, state)
    """
)

_STOPPED = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from trainer.rank.process import new_state, on_sigterm_write

    state = new_state()
    on_sigterm_write({"state": state, "rank_file": Path(sys.argv[1])})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    """
)


def _run(script, rank_file):
    return subprocess.run([sys.executable, "-c", script, str(rank_file)], capture_output=True, text=True, timeout=60)


def test_a_rank_stopped_while_it_records_its_own_oom_keeps_the_oom(tmp_path):
    r = _run(_RACE, tmp_path / "rank0.json")
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert r.returncode == ExitCode.OOM, r.stderr
    assert got["status"] == "oom" and got["error"] == "MemoryError: can't allocate memory", got


def test_a_rank_stopped_by_the_launcher_says_so(tmp_path):
    r = _run(_STOPPED, tmp_path / "rank0.json")
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert r.returncode == 128 + 15
    assert got["status"] == "error" and got["error"].startswith("stopped by signal 15"), got
