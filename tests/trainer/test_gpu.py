"""GPU checks (nccl, CUDA OOM, NVML, MFU): skipped without a CUDA device; never needed in CI.

Run on a GPU machine with:  python -m pytest tests/test_gpu.py -v -s
"""

import json
import subprocess
import sys

import pytest
import torch

from invariance import TOL, VARIANTS_2, max_rel_diff, run_variants
from support import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = REPO
BASE = str(ROOT / "configs" / "tiny_cpu.yaml")
# Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads), built from config.
HALF_B = [
    "ppotune.tiny.hidden_size=896",
    "ppotune.tiny.num_hidden_layers=24",
    "ppotune.tiny.num_attention_heads=14",
    "ppotune.tiny.num_key_value_heads=2",
    "ppotune.tiny.intermediate_size=4864",
]


def _train(tmp_path, *args):
    result = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner.cli",
            "train",
            BASE,
            "ppotune.device=cuda",
            *map(str, args),
            "--result",
            str(result),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(result.read_text())


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_e2e_nccl(tmp_path, strategy):
    n = torch.cuda.device_count()
    proc, r = _train(
        tmp_path,
        f"actor_rollout_ref.actor.strategy={strategy}",
        "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.model.enable_activation_offload=true",
        "--nproc",
        n,
        "--steps",
        3,
        "--warmup",
        1,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["status"] == "ok" and r["environment"]["backend"] == "nccl"
    assert r["summary"]["memory_source"] == "torch_cuda" and r["summary"]["peak_memory_allocated_gb"] > 0
    assert not any("no effect on CPU" in n for n in r["notes"])
    print(strategy, r["summary"]["throughput"], r["summary"]["peak_memory_reserved_gb"])


def test_real_cuda_oom_under_the_cap(tmp_path):
    proc, r = _train(tmp_path, *HALF_B, "--nproc", 1, "--steps", 1, "--memory-limit-gb", 1.0)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["status"] == "oom" and "out of memory" in r["error"].lower()


def test_mfu_half_b_shape(tmp_path):
    proc, r = _train(
        tmp_path,
        *HALF_B,
        "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
        "critic.fsdp.dtype=bfloat16",
        "actor_rollout_ref.ref.fsdp_config.dtype=bfloat16",
        "--nproc",
        1,
        "--steps",
        3,
        "--warmup",
        1,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mfu = r["summary"]["mfu"]
    print(f"MFU (actor update, 0.5B shape, {r['environment']['device_name']}): {mfu}")
    assert mfu is not None and 0 < mfu < 1


def test_invariance_on_cuda(tmp_path):
    n = torch.cuda.device_count()
    got = run_variants(n, tmp_path, {**VARIANTS_2}, env={"PPOTUNE_TEST_DEVICE": "cuda"})
    for name, res in got.items():
        for part in ("actor", "critic"):
            rel, key = max_rel_diff(res[part], got["base"][part])
            assert rel <= 10 * TOL, f"{name}: {part}.{key} {rel:.2e}"


def test_nvml_sees_the_device():
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total > 0
