"""trainer.launch.ranks.RankGroup on real processes: small Python modules as ranks (no torch), so every case of
what torchrun's agent did for us is checked in seconds: the environment, one output pipe, ending the
survivors of a failed rank, signals, the group's exit code, no orphan when the launcher is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import trainer.launch.ranks as ranks_mod
from support import processes_with, wait_until
from trainer.launch.proc import quota_cpus, usable_cpus
from trainer.launch.ranks import RankGroup

# a rank: prints what it was given, then does what RANK_<r> says (exit:N | sleep | ignore-term | signal:N)
RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    r = os.environ["RANK"]
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    print("rank", r, *(os.environ[k] for k in keys), *sys.argv[1:], flush=True)
    what = os.environ.get("RANK_" + r, "exit:0")
    if what == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if what.startswith("exit:"):
        sys.exit(int(what[5:]))
    if what.startswith("signal:"):
        os.kill(os.getpid(), int(what[7:]))
    time.sleep(600)
    """
)


@pytest.fixture
def env(tmp_path):
    (tmp_path / "fake_rank.py").write_text(RANK)
    return dict(os.environ, PYTHONPATH=str(tmp_path))


def lines(group: RankGroup) -> list[str]:
    return [line.rstrip("\n") for line in group.stdout]


def test_every_rank_gets_its_environment_and_one_pipe_carries_all_output(env):
    g = RankGroup(["fake_rank", "--arg", "x"], nproc=3, env={**env, "OMP_NUM_THREADS": "1"})
    out = sorted(lines(g))
    assert g.wait(timeout=30) == 0 and g.failed_rank is None
    port = out[0].split()[7]
    assert int(port) < ranks_mod._ephemeral_low()  # no outgoing connection is given it meanwhile
    assert out == [f"rank {r} {r} {r} 3 3 127.0.0.1 {port} 1 --arg x" for r in range(3)]


def test_a_failed_rank_ends_its_peers_and_gives_the_group_its_code(env):
    t0 = time.monotonic()
    g = RankGroup(["fake_rank"], nproc=2, env={**env, "RANK_0": "sleep", "RANK_1": "exit:3"})
    assert g.wait(timeout=30) == 3 and g.failed_rank == 1
    assert time.monotonic() - t0 < ranks_mod.FAIL_GRACE_S  # the sleeper took SIGTERM, no SIGKILL needed
    assert all(subprocess_gone(pid) for pid in g.pids)


def test_a_peer_that_ignores_sigterm_is_sigkilled_after_the_grace(env, monkeypatch):
    monkeypatch.setattr(ranks_mod, "FAIL_GRACE_S", 1.0)
    g = RankGroup(["fake_rank"], nproc=2, env={**env, "RANK_0": "ignore-term", "RANK_1": "signal:6"})
    assert g.wait(timeout=30) == -signal.SIGABRT and g.failed_rank == 1
    assert all(subprocess_gone(pid) for pid in g.pids)


def test_send_signal_reaches_every_rank_and_poll_says_when_all_ended(env):
    g = RankGroup(["fake_rank"], nproc=2, env={**env, "RANK_0": "sleep", "RANK_1": "sleep"})
    assert wait_until(lambda: len(processes_with("fake_rank")) >= 2, 30)
    assert g.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        g.wait(timeout=0.2)
    g.send_signal(signal.SIGTERM)
    assert g.wait(timeout=30) == -signal.SIGTERM
    assert g.poll() == -signal.SIGTERM


def test_the_ranks_die_with_a_sigkilled_launcher(env, tmp_path):
    launcher = textwrap.dedent(
        """
        import time
        from trainer.launch.ranks import RankGroup
        g = RankGroup(["fake_rank", "%s"], nproc=2)
        time.sleep(600)
        """
        % tmp_path
    )
    env = {**env, "RANK_0": "sleep", "RANK_1": "sleep"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], repo])
    p = subprocess.Popen([sys.executable, "-c", launcher], env=env)
    try:
        assert wait_until(lambda: len(processes_with(str(tmp_path))) >= 3, 30)  # the launcher and 2 ranks
        p.kill()
        p.wait()
        assert wait_until(lambda: not processes_with(str(tmp_path)), 10), processes_with(str(tmp_path))
    finally:
        for q in processes_with(str(tmp_path)):
            q.kill()


def subprocess_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_threads_split_the_cores_the_cgroup_quota_allows():
    """A container limited by quota (docker --cpus 2) on a big host: os.cpu_count() is the host's, cpu.max says 2."""
    assert quota_cpus("200000 100000") == 2 and quota_cpus("150000 100000") == 2  # 1.5 CPUs: 2 threads can run
    assert quota_cpus("50000 100000") == 1 and quota_cpus("100000 100000") == 1
    assert quota_cpus("max 100000") is None and quota_cpus("-1 100000") is None  # no quota (v2, v1)
    assert quota_cpus("") is None and quota_cpus("x 100000") is None
    assert 1 <= usable_cpus() <= (os.cpu_count() or 1)
    env = ranks_mod.rank_env({}, rank=0, nproc=2, port=1)
    assert env["OMP_NUM_THREADS"] == str(max(1, usable_cpus() // 2))
    assert ranks_mod.rank_env({"OMP_NUM_THREADS": "3"}, rank=0, nproc=2, port=1)["OMP_NUM_THREADS"] == "3"
