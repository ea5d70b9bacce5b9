"""`ppotune train` end to end: 2 real rank processes on gloo, the tiny preset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pandas as pd
import psutil
import pytest

from support import REPO
from trainer import contracts

ROOT = REPO
BASE = str(ROOT / "configs" / "tiny_cpu.yaml")
SCHEMA = json.loads((ROOT / "trainer" / "result_schema.json").read_text())
PHASES = [*contracts.PHASES, contracts.STEP_TIMING_KEY]


def train(*args, result: Path, timeout: int = 300, env: dict | None = None):
    cmd = [sys.executable, "-m", "tuner.cli", "train", *map(str, args), "--result", str(result)]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},
    )
    data = json.loads(result.read_text()) if result.exists() else None
    if data is not None:
        jsonschema.validate(data, SCHEMA)
    return proc, data


def _no_process_mentions(token: str) -> None:
    left = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(token in part for part in (p.info["cmdline"] or [])):
                left.append(p.pid)
        except psutil.Error:
            pass
    assert not left, f"processes left behind: {left}"


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_three_steps_on_two_processes(tmp_path, strategy):
    proc, r = train(
        BASE,
        f"actor_rollout_ref.actor.strategy={strategy}",
        "--nproc",
        2,
        "--steps",
        3,
        "--warmup",
        1,
        result=tmp_path / "r.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert r["status"] == "ok" and r["error"] is None
    assert r["summary"]["throughput"] > 0 and r["summary"]["num_measured_steps"] == 2
    assert r["environment"]["world_size"] == 2 and r["environment"]["backend"] == "gloo"
    assert len(r["steps"]) == 3 and r["steps"][0]["warmup"] and not r["steps"][1]["warmup"]
    for step in r["steps"]:
        for phase in PHASES:
            assert step[f"timing_s/{phase}"] >= 0, phase
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/entropy",
            "actor/pg_clipfrac",
            "actor/ppo_kl",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/grad_norm",
            "reward/mean",
            "actor/kl_coef",
            "perf/peak_rss_gb",
        ):
            assert key in step, key
        assert step["perf/mfu/actor"] is None  # no peak-FLOPs figure for a CPU
    assert set(r["summary"]["timing_s"]) >= set(PHASES)
    # CPU: the objective is the RSS gained above the post-start level; the absolute peak (libraries included) beside
    s = r["summary"]
    assert s["memory_source"] == "rss_above_start" and 0 < s["peak_memory_gb"] < s["peak_rss_gb"]
    assert s["peak_rss_gb"] > 0.05 and s["rss_start_gb"] > 0.05
    assert s["throughput_ci"][0] <= s["throughput"] <= s["throughput_ci"][1] and s["num_measured_steps"] >= 2
    assert s["lengths"]["prompt"]["max"] <= 64 and s["lengths"]["response"]["max"] <= 32
    assert r["config"]["actor_rollout_ref"]["actor"]["strategy"] == strategy
    assert not any("vLLM-only" in n for n in r["notes"])  # unset vLLM knobs are not noise


@pytest.mark.slow
def test_profile_step_prints_where_the_time_went_and_is_not_measured(tmp_path):
    proc, r = train(BASE, "--nproc", 1, "--steps", 3, "--warmup", 1, "--profile-step", 2, result=tmp_path / "r.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "profile of step 2 (rank 0, cpu; not measured)" in proc.stdout
    table = proc.stdout.split("profile of step 2", 1)[1]
    assert "Self CPU" in table and "aten::mm" in table  # the operators of a real step, by host time
    assert [s["warmup"] for s in r["steps"]] == [True, True, False]  # the profiled step is left out
    assert r["summary"]["num_measured_steps"] == 1 and r["config"]["ppotune"]["profile_step"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy, n", [("fsdp2", 2)])
def test_three_steps_with_vllm_rollout(tmp_path, vllm_installed, strategy, n):
    """rollout.name=vllm: a real vLLM engine per rank generates every step from the weights pushed to it.
    FSDP2 with n > 1 here; FSDP1's weight push is tests/trainer/engine/test_vllm_rollout.py's, and FSDP1 trials with
    vLLM run end to end in tests/e2e/test_search_vllm.py (the demo's strategy)."""
    proc, r = train(
        BASE,
        f"actor_rollout_ref.actor.strategy={strategy}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=true",  # no torch.compile (test_vllm_rollout's FSDP1 run has it)
        f"actor_rollout_ref.rollout.n={n}",
        "ppotune.vllm_cpu_memory_gb=0.25",
        "--nproc",
        2,
        "--steps",
        3,
        "--warmup",
        1,
        result=tmp_path / "r.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert r["status"] == "ok" and r["summary"]["throughput"] > 0
    for step in r["steps"]:
        assert step["timing_s/gen"] > 0 and step["timing_s/update_weights"] > 0
        assert step["response_length/mean"] > 0
    assert r["summary"]["timing_s"]["update_weights"] > 0
    # rollout.n responses per prompt: the token count covers train_batch_size x n sequences
    assert r["steps"][0]["perf/total_num_tokens"] >= 16 * n * 8
    notes = "\n".join(r["notes"])
    assert "actor_rollout_ref.rollout.free_cache_engine: no effect on CPU" in notes
    assert "actor_rollout_ref.rollout.enable_sleep_mode: no effect on CPU" in notes
    assert "vLLM-only" not in notes
    # the engine's KV cache (0.5 x 0.25 GiB per rank) is part of the measured memory
    assert r["summary"]["peak_memory_gb"] > 0.125


@pytest.mark.slow
def test_knobs_without_effect_on_cpu_are_reported(tmp_path):
    proc, r = train(
        BASE,
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch=true",
        "actor_rollout_ref.model.enable_activation_offload=true",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
        "--nproc",
        2,
        "--steps",
        1,
        "--save",
        tmp_path / "ckpt",
        "--wandb",
        result=tmp_path / "r.json",
        env={"WANDB_DIR": str(tmp_path), "WANDB_MODE": None, "WANDB_API_KEY": None},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = "\n".join(r["notes"])
    for key in (
        "actor_rollout_ref.actor.fsdp_config.param_offload: no effect on CPU",
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch: applied, but no effect on CPU",
        "actor_rollout_ref.model.enable_activation_offload: no effect on CPU",
        "actor_rollout_ref.rollout.gpu_memory_utilization: no effect with rollout.name=hf",
    ):
        assert key in notes
    # --wandb without credentials records an offline run
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    # a full run ends with an HF-format checkpoint that loads offline
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "actor", local_files_only=True)
    critic = AutoModelForTokenClassification.from_pretrained(tmp_path / "ckpt" / "critic", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt" / "actor", local_files_only=True)
    assert (
        actor.config.num_hidden_layers == 2
        and critic.config.num_labels == 1
        and tok.decode(tok("12+3=")["input_ids"]) == "12+3="
    )


@pytest.mark.slow
def test_parquet_input_and_local_checkpoint(tmp_path):
    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": f"#### {2 * i}"},
            "extra_info": {"index": i},
        }
        for i in range(40)
    ]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    # first a run that saves a checkpoint, then a run that starts from it with the parquet data
    proc, _ = train(BASE, "--nproc", 1, "--steps", 1, "--save", tmp_path / "ckpt", result=tmp_path / "a.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, r = train(
        BASE,
        f"data.train_files={path}",
        f"actor_rollout_ref.model.path={tmp_path / 'ckpt' / 'actor'}",
        "--nproc",
        2,
        "--steps",
        2,
        "--warmup",
        1,
        result=tmp_path / "b.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert r["status"] == "ok" and r["config"]["data"]["train_files"] == str(path)


@pytest.mark.slow
def test_memory_cap_gives_a_real_oom_and_no_process_survives(tmp_path):
    # the same cap: the tiny model fits, a wider one runs out of memory for real during a step
    proc, r = train(BASE, "--nproc", 2, "--steps", 1, "--memory-limit-gb", 0.15, result=tmp_path / "fits.json")
    assert proc.returncode == 0 and r["status"] == "ok", proc.stderr[-2000:]
    proc, r = train(
        BASE,
        "ppotune.tiny.hidden_size=512",
        "ppotune.tiny.intermediate_size=2048",
        "--nproc",
        2,
        "--steps",
        2,
        "--memory-limit-gb",
        0.15,
        result=tmp_path / "oom.json",
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert r["status"] == "oom"
    assert "can't allocate memory" in r["error"] or "out of memory" in r["error"].lower()
    assert r["oom_rank"] in (0, 1) and r["oom_phase"] in (
        "setup",
        "gen",
        "reward",
        "old_log_prob",
        "ref",
        "values",
        "adv",
        "update_critic",
        "update_actor",
    )
    _no_process_mentions(str(tmp_path))


@pytest.mark.slow
def test_one_rank_crashing_ends_the_run(tmp_path):
    proc, r = train(BASE, "ppotune.fault=crash", "--nproc", 2, "--steps", 2, result=tmp_path / "r.json", timeout=120)
    assert proc.returncode == 1
    assert r["status"] == "error" and "rank(s) [1]" in r["error"]
    _no_process_mentions(str(tmp_path))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["actor_rollout_ref.actor.not_a_knob=1"], "actor_rollout_ref.actor.not_a_knob: unknown key"),
        (["data.train_batch_size=lots"], "data.train_batch_size: expected int"),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: 3 does not divide",
        ),
        (
            ["actor_rollout_ref.model.path=/no/such/model"],
            "actor_rollout_ref.model.path: not 'tiny' and not a local HF checkpoint",
        ),
        (["data.train_files=/no/such/train.parquet"], "data.train_files: file not found"),
        (["--steps", "3", "--profile-step", "4"], "ppotune.profile_step: must be 0 (off) or a step in [1, "),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle):
    proc, r = train(BASE, *args, "--nproc", 2, result=tmp_path / "r.json", timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "tiny_cpu.yaml" in lines[0]
    assert r["status"] == "error" and r["error"].startswith("config:")


def test_missing_config_file_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "train", str(tmp_path / "nope.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "nope.yaml: config: file not found" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_bf16_mixed_precision(tmp_path, strategy):
    proc, r = train(
        BASE,
        f"actor_rollout_ref.actor.strategy={strategy}",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16",
        "critic.fsdp.mixed_precision.param_dtype=bf16",
        "--nproc",
        2,
        "--steps",
        1,
        result=tmp_path / "r.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert r["status"] == "ok" and r["steps"][0]["actor/grad_norm"] > 0
    # verl's default: nothing to say about precision (the fp32 demo config says it in every run)
    assert not any("mixed_precision" in n for n in r["notes"]), r["notes"]
