"""scripts/gpu_check.sh without a GPU: its --dry-run (the script parses, tests/trainer/engine/test_gpu.py imports,
its plan fits the GPU-time budget, each group's estimate and limit printed before anything would run), the limit
rule (each group's share of the budget from the plan alone), the script's group loop with a stand-in runner, the
runner's per-test files under the logs folder when a test is interrupted, and the invariance suite's per-variant
catch. A GPU loan is minutes long: a check that cannot run, overruns or loses its output must fail here, not there."""

import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from support import REPO

GPU_TESTS = REPO / "tests" / "trainer" / "engine" / "test_gpu.py"


@pytest.fixture(scope="module")
def gpu():
    """tests/trainer/engine/test_gpu.py as a module (its tests are not collected from here: it is not a test file
    of this one's)."""
    spec = importlib.util.spec_from_file_location("gpu_check_plan", GPU_TESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_check_plans_its_groups_within_the_budget():
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHON": sys.executable},
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # group NAME ESTIMATE_S LIMIT_S DEADLINE_S TEST...
    groups = [line.split() for line in proc.stdout.splitlines() if line.startswith("group ")]
    assert [g[1] for g in groups] == ["1_profile", "2_correctness", "3_rest"]
    assert groups[0][5:] == ["test_profiled_step_at_a_realistic_shape"]  # the question a loan must answer first
    assert groups[1][5:] == ["test_invariance_on_cuda"]  # correctness, activation offload included
    estimates, limits, deadlines = ([int(g[i]) for g in groups] for i in (2, 3, 4))
    (total,) = [line for line in proc.stdout.splitlines() if line.startswith("total ")]
    words = total.split()
    spent, reserved, budget = int(words[1]), int(words[4]), int(words[-3])
    assert spent == sum(estimates) <= budget <= 360
    assert reserved == sum(limits) <= budget  # the limits never sum past the budget
    assert all(limit >= est for limit, est in zip(limits, estimates, strict=True))
    assert deadlines == [sum(limits[: i + 1]) for i in range(len(limits))]


def test_each_group_limit_is_its_own_share_of_the_budget(gpu):
    """From the plan alone: the limits sum within the budget, and a group's limit is its estimate scaled to the
    budget whatever the other groups estimate (so no other group's estimate, or overrun, can move it)."""
    plan = [("a", 150, []), ("b", 95, []), ("c", 80, [])]
    limits = gpu.group_limits(plan, 360)
    assert [name for name, *_ in limits] == ["a", "b", "c"]
    assert sum(limit for _, _, limit, _ in limits) <= 360
    assert [limit for _, _, limit, _ in limits] == [150 * 360 // 325, 95 * 360 // 325, 80 * 360 // 325]
    assert [deadline for *_, deadline in limits] == [166, 271, 359]
    # a plan over its budget (which --plan refuses) is still scaled within it
    assert sum(limit for _, _, limit, _ in gpu.group_limits([("a", 300, []), ("b", 200, [])], 360)) <= 360
    shipped = gpu.group_limits()
    assert sum(limit for _, _, limit, _ in shipped) <= gpu.BUDGET_S


def _simulate(limits, wanted_s):
    """What each group gets under scripts/gpu_check.sh's rule (a group runs until its deadline, stopped there):
    [(allowed_s, used_s)]; ``wanted_s`` is how long each group would run if let."""
    at, out = 0, []
    for (_, _, _, deadline), want in zip(limits, wanted_s, strict=True):
        allowed = deadline - at
        used = min(want, allowed)
        out.append((allowed, used))
        at += used
    return out


def test_an_overrun_takes_from_its_own_group_and_leftovers_pass_on(gpu):
    limits = gpu.group_limits()
    own = [limit for _, _, limit, _ in limits]
    # the first group would run forever: it is stopped at its own limit, every later group keeps all of its own
    overrun = _simulate(limits, [10**6, *own[1:]])
    assert overrun[0] == (own[0], own[0])
    assert [allowed for allowed, _ in overrun[1:]] == own[1:]
    # every group overruns: each one still gets exactly its own limit
    assert [allowed for allowed, _ in _simulate(limits, [10**6] * len(limits))] == own
    # the first group ends 60 s early: the second gets its own limit and those 60 s, the third its own limit
    early = _simulate(limits, [own[0] - 60, 10**6, 10**6])
    assert [allowed for allowed, _ in early] == [own[0], own[1] + 60, own[2]]


# A stand-in for python in scripts/gpu_check.sh: a two-group plan of 12 s; group g1 writes a log under the folder
# the script gives it, then would run forever (it prints a summary when interrupted, as the runner does); g2 passes.
FAKE_PYTHON = r"""#!/usr/bin/env bash
case "$*" in
    *--plan) printf '%s\n' 'group g1 5 6 6 test_slow' 'group g2 5 6 12 test_quick' \
        'total 10 s estimated, 12 s of limits, of a 12 s budget' ;;
    *"--group g1")
        mkdir -p "$PPOTUNE_GPU_LOGS/test_slow-x" && echo started > "$PPOTUNE_GPU_LOGS/test_slow-x/train-1.log"
        trap 'printf "%s\n" "===== summary" "INTERRUPTED test_slow"; exit 1' INT
        sleep 100 &
        wait ;;
    *"--group g2") printf '%s\n' "===== summary" "PASS  test_quick" ;;
    *) exit 0 ;;
esac
"""


def test_the_script_stops_an_overrunning_group_at_its_deadline_and_keeps_its_files(tmp_path):
    """The script's own loop, with a stand-in runner: the first group overruns and is interrupted inside its
    limit, the second still gets its own limit; the first group's file under the logs folder comes back packed,
    and the end of the output holds every group's summary."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    logs = tmp_path / "logs"
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_GRACE": "1", "PATH": os.environ["PATH"]}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(logs)], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = {line.split()[2].rstrip(":"): line for line in proc.stdout.splitlines() if "s until its deadline" in line}
    assert set(starts) == {"g1", "g2"}, proc.stdout
    allowed_g2 = int(starts["g2"].split(" s until")[0].split()[-1])
    # g1 overran but was stopped before its deadline (6 s): g2 keeps its limit (6 s), give or take a clock tick
    assert allowed_g2 >= 6 - 1, starts["g2"]
    assert "INTERRUPTED test_slow" in (logs / "g1.log").read_text()
    with tarfile.open(logs / "tests.tar.gz") as tar:
        member = tar.extractfile("work/g1/test_slow-x/train-1.log")
        assert member is not None and member.read().decode().strip() == "started"
    assert not (logs / "work").exists()  # packed: a loan brings back a few files only
    tail = proc.stdout[proc.stdout.index("every group's summary") :]
    assert "INTERRUPTED test_slow" in tail and "PASS  test_quick" in tail


def test_every_planned_test_writes_under_the_logs_folder(gpu, tmp_path, monkeypatch):
    """The contract: the runner makes each test's folder under LOGS_ENV's folder, the subprocess helper streams
    into a log file there, and the planned tests go through those helpers rather than capture their
    subprocesses' output (a test stopped by its limit would lose it)."""
    monkeypatch.setenv(gpu.LOGS_ENV, str(tmp_path / "logs"))
    folder = gpu._test_folder("test_e2e_nccl[fsdp]")
    assert folder.parent == tmp_path / "logs" and folder.name.startswith("test_e2e_nccl_fsdp_-")
    code = "import sys; print('out'); print('err', file=sys.stderr)"
    proc = gpu._logged(folder, "train", [sys.executable, "-c", code])
    assert proc.returncode == 0 and sorted(proc.stdout.split()) == ["err", "out"]
    assert (folder / "train-1.log").read_text() == proc.stdout
    for _, _, names in gpu.PLAN:
        for name in names:
            source = inspect.getsource(getattr(gpu, name))
            assert "capture_output" not in source and "tempfile" not in source, name
    for helper in (gpu._logged, gpu._train):
        assert "capture_output" not in inspect.getsource(helper)
    assert "run_variants_caught" in inspect.getsource(gpu.test_invariance_on_cuda)


RUNNER = """
import sys
sys.path.insert(0, "tests/trainer/engine")
import test_gpu

def test_slow(tmp_path):
    code = "import time; print('started', flush=True); time.sleep(120)"
    test_gpu._logged(tmp_path, "train", [sys.executable, "-c", code])

sys.exit(test_gpu.run_tests([("test_slow", test_slow)]))
"""


def test_an_interrupted_test_leaves_its_output_under_the_logs_folder(tmp_path):
    """The runner's path on a CPU: a test whose subprocess runs past its time is interrupted as the script's
    timeout does it (SIGINT to the process group); its log is under the logs folder with what it had printed, the
    runner prints that log's last lines, and the summary says INTERRUPTED."""
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PPOTUNE_GPU_LOGS": str(logs), "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not any("started" in p.read_text() for p in logs.glob("test_slow-*/train-*.log")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(out)
    assert proc.returncode == 1, out
    (log,) = logs.glob("test_slow-*/train-1.log")
    assert log.read_text().startswith("started\n")  # then the child's own KeyboardInterrupt: it got the SIGINT too
    assert f"lines of {log}:\nstarted\n" in out
    assert "INTERRUPTED test_slow" in out[out.index("===== summary") :]


def _fake_launch(launches: list):
    """A stand-in for the worker's launch: saves each variant in order, as the worker does, and fails (exit 1,
    an exception line in its log) at the first variant whose name starts with ``boom``."""

    def launch(spec, log):
        names = list(json.loads(spec.read_text()))
        launches.append(names)
        for name in names:
            if name.startswith("boom"):
                log.write_text(f"Traceback (most recent call last):\nRuntimeError: {name} broke\nrank 0 exited\n")
                return 1
            torch.save({"name": name}, spec.parent / f"{name}.pt")
        log.write_text("done\n")
        return 0

    return launch


def test_each_invariance_variant_is_caught_alone(tmp_path):
    from invariance import Check, caught_failures, run_variants_caught

    variants = {"a": {}, "boom_1": {}, "b": {}, "c": {}, "boom_2": {}, "d": {}}
    launches: list = []
    got, missing = run_variants_caught(2, tmp_path, variants, launch=_fake_launch(launches))
    assert sorted(got) == ["a", "b", "c", "d"] and got["d"] == {"name": "d"}
    assert sorted(missing) == ["boom_1", "boom_2"]
    assert "RuntimeError: boom_1 broke" in missing["boom_1"] and "launch exit 1" in missing["boom_1"]
    # one more launch per failure, each from the variant after the failed one
    assert launches == [list(variants), ["b", "c", "boom_2", "d"], ["d"]]
    # the checks: a missing variant is reported, not a KeyError; a comparison that raises is its check's alone
    (line,) = caught_failures(got, missing, Check("boom_1", "a"))
    assert "not compared" in line and "boom_1 broke" in line
    (line,) = caught_failures(got, missing, Check("b", "a"))
    assert "the comparison raised KeyError" in line


def test_launches_that_save_nothing_give_up_the_rest(tmp_path):
    from invariance import BARREN_LAUNCHES, run_variants_caught

    variants = {f"boom_{i}": {} for i in range(10)}
    launches: list = []
    got, missing = run_variants_caught(1, tmp_path, variants, launch=_fake_launch(launches))
    assert not got and len(launches) == BARREN_LAUNCHES and sorted(missing) == sorted(variants)
    assert "not run: 3 launches in a row saved nothing" in missing["boom_9"]
