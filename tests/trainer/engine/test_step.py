"""A training micro-batch waits for the device no more often in ppotune's actor than in verl's (issue 24): the
overhead benchmark (benchmarks/bench_step_overhead.py) run small, both engines side by side on their actors,
each pass counted at the Python level and at torch's dispatcher (benchmarks/step_counter.py).

Without the verl venv (.venv-verl) only ppotune's side runs, against the count verl's side was measured at
(benchmarks/README.md): one read of the loss per micro-batch, besides transformers' own."""

import json
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.slow  # two worker processes that import torch, transformers (and verl)

BENCH = REPO / "benchmarks" / "bench_step_overhead.py"
VERL_PY = REPO / ".venv-verl" / "bin" / "python"
#: verl 0.9.1's syncs per training micro-batch where its venv is absent (benchmarks/README.md): its forward_step
#: reads the loss with ``.item()``; transformers' packed-sequence check reads one more bool per forward
VERL_MICRO_BATCH_SYNCS = 2.0


def _bench(tmp_path, sides: str, python: str) -> dict:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(BENCH), "--rounds", "1", "--timed-runs", "0", "--layers", "2", "--batch", "4"]
    cmd += ["--micro", "2", "--prompt", "8", "--response", "8", "--offloads", "none,param_offload"]
    cmd += ["--sides", sides, "--ours-python", python, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    # 1: a goal of the benchmark missed at this small shape (its claim, benchmarks/README.md); the syncs are this test's
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout)
    return json.loads(out.read_text())["summary"]


def test_a_training_micro_batch_syncs_no_more_than_in_verl(tmp_path):
    if VERL_PY.exists():
        summary = _bench(tmp_path, "ours,verl", str(VERL_PY))
    else:
        summary = _bench(tmp_path, "ours", sys.executable)
    for variant, rows in summary.items():
        ours = rows["micro_batch"]["ours"]["syncs"]
        verl = rows["micro_batch"]["verl"]["syncs"] if "verl" in rows["micro_batch"] else VERL_MICRO_BATCH_SYNCS
        assert ours <= verl, f"{variant}: a training micro-batch syncs {ours} times, verl's {verl}"
        # every pass: never more waits than verl's
        for name in ("log_prob", "update_M", "optimizer_step"):
            if "verl" in rows[name]:
                assert rows[name]["ours"]["syncs"] <= rows[name]["verl"]["syncs"], (variant, name, rows[name])
