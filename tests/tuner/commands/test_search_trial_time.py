"""``ppotune search``'s trial length and time: a verl run file's ``ppotune.steps``/``warmup`` hold unless ``--steps``/
``--warmup`` say; ``--dry-run`` of a GPU job on a machine without a GPU prints a per-trial estimate reckoned from the
model's shape (config.json), the lengths, the batch and the world, its assumptions, and the hang limits drawn from
it. The model and data are stand-ins (a 7B config.json, files that pass the checks): nothing runs them."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from support import REPO
from tuner.cli import main
from tuner.commands.search_flags import DEFAULT_STEPS, DEFAULT_WARMUP, trial_length

VERL_PY = REPO / ".venv-verl" / "bin" / "python"
SPACE = REPO / "search_spaces" / "verl_gpu.yaml"
QWEN_7B = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def _ns(steps=None, warmup=None):
    return argparse.Namespace(steps=steps, warmup=warmup)


def test_the_run_files_length_holds_unless_a_flag_says():
    assert trial_length(_ns(), {"steps": 4, "warmup": 1}) == (4, 1)
    assert trial_length(_ns(), {"steps": 6}) == (6, DEFAULT_WARMUP)
    assert trial_length(_ns(), {}) == (DEFAULT_STEPS, DEFAULT_WARMUP)  # ppotune's engine, or a run file silent on it
    assert trial_length(_ns(steps=10), {"steps": 4, "warmup": 2}) == (10, 2)
    assert trial_length(_ns(steps=2), {"steps": 4, "warmup": 2}) == (2, 1)  # a measured step is left
    assert trial_length(_ns(warmup=0), {"steps": 4, "warmup": 2}) == (4, 0)


def _stand_in(tmp_path, *, config: dict, response_length: int = 1024) -> str:
    """configs/verl_gpu_grpo.yaml with its REPLACE paths under ``tmp_path``: a model directory whose config.json is
    ``config`` (the rest: files that pass the checks) and two one-row parquet files."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from trainer.datafiles import required_columns

    model = tmp_path / "models" / "Qwen2.5-7B-Instruct"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    data = tmp_path / "data" / "gsm8k"
    data.mkdir(parents=True, exist_ok=True)
    table = pa.table({c: [json.dumps({"x": 1})] for c in required_columns()})
    for name in ("train", "test"):
        pq.write_table(table, data / f"{name}.parquet")
    text = (REPO / "configs" / "verl_gpu_grpo.yaml").read_text().replace("/REPLACE/", f"{tmp_path}/")
    text = text.replace("data.max_response_length=1024", f"data.max_response_length={response_length}")
    run = tmp_path / f"grpo_{response_length}.yaml"
    run.write_text(text)
    return str(run)


def _dry_run(capsys, run: str, tmp_path, *extra: str) -> str:
    argv = ["search", run, "--engine", "verl", "--engine-python", str(VERL_PY), "--space", str(SPACE)]
    assert main([*argv, "--trials", "8", "--out", str(tmp_path / "out"), "--dry-run", *extra]) == 0
    return capsys.readouterr().out


def _per_step_s(text: str) -> float:
    return float(re.search(r"steps x ~(\d+) s \(generation", text).group(1))


@pytest.fixture()
def verl_python():
    if not VERL_PY.exists():
        pytest.skip(f"verl venv not installed ({VERL_PY} is missing: scripts/install_test_deps.sh)")


def test_a_gpu_jobs_dry_run_reckons_a_trial_from_the_model(tmp_path, capsys, verl_python):
    base = _dry_run(capsys, _stand_in(tmp_path / "a", config=QWEN_7B), tmp_path / "a")
    assert "trials: cuda x8, up to 4 steps (1 warm-up)" in base  # the run file's ppotune.steps, not search's 8
    assert "30% MFU" in base and "no GPU visible; --assume-gpu names one" in base
    assert "hang limits: no first step within 900 s, no next step within 300 s" in base  # 7B on H100s: the floors
    assert "this machine shows 0 GPUs: the search itself needs 8" in base

    bigger = {**QWEN_7B, "num_hidden_layers": 56}
    deeper = _dry_run(capsys, _stand_in(tmp_path / "b", config=bigger), tmp_path / "b")
    longer = _dry_run(capsys, _stand_in(tmp_path / "c", config=QWEN_7B, response_length=4096), tmp_path / "c")
    assert _per_step_s(deeper) > 1.5 * _per_step_s(base) and _per_step_s(longer) > 2 * _per_step_s(base)
    assert "no next step within 300 s" not in longer  # 4k responses: the step limit is 3x the estimate

    # --steps wins, and so does a named GPU and an explicit limit
    a100 = _dry_run(
        capsys, str(tmp_path / "a" / "grpo_1024.yaml"), tmp_path / "a", "--steps", "6", "--assume-gpu", "A100"
    )
    assert "up to 6 steps (1 warm-up)" in a100 and "assumes A100:" in a100
    assert _per_step_s(a100) > 2.5 * _per_step_s(base)
    flag = _dry_run(capsys, str(tmp_path / "a" / "grpo_1024.yaml"), tmp_path / "a", "--step-timeout", "42")
    assert "no next step within 42 s (your --step-timeout)" in flag
