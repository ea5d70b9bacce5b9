"""scripts/gpu_check.sh without a GPU (its --dry-run): the script parses, tests/trainer/engine/test_gpu.py imports,
and its plan (the profile at the realistic shape, then correctness, then the rest) fits the GPU-time budget, each
group's estimate printed before anything would run. A GPU loan is minutes long: a check that cannot run or overruns must
fail here, not there."""

import os
import subprocess
import sys

from support import REPO


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
    groups = [line.split() for line in proc.stdout.splitlines() if line.startswith("group ")]
    assert [g[1] for g in groups] == ["1_profile", "2_correctness", "3_rest"]
    assert groups[0][3:] == ["test_profiled_step_at_a_realistic_shape"]  # the question a loan must answer first
    assert groups[1][3:] == ["test_invariance_on_cuda"]  # correctness, activation offload included
    (total,) = [line for line in proc.stdout.splitlines() if line.startswith("total ")]
    spent, budget = int(total.split()[1]), int(total.split()[-3])
    assert spent == sum(int(g[2]) for g in groups) <= budget <= 360
