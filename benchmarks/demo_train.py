"""One real ``ppotune train`` of the embedded demo (configs/tiny_cpu.yaml + overrides) for the benchmarks
that compare configurations side by side; -> the result's summary."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_summary(overrides: list[str], *, steps: int, nproc: int) -> dict:
    """Run the demo with ``overrides`` for ``steps`` steps (the first one warm-up) on ``nproc`` processes.
    Raises ``subprocess.CalledProcessError`` when the run fails (e.g. out of memory)."""
    with tempfile.TemporaryDirectory() as d:
        result = Path(d) / "r.json"
        subprocess.run(
            [sys.executable, "-m", "tuner.cli", "train", str(ROOT / "configs" / "tiny_cpu.yaml"), *overrides]
            + ["--nproc", str(nproc), "--steps", str(steps), "--warmup", "1", "--result", str(result)],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        return json.loads(result.read_text())["summary"]
