"""The config: verl keys, one place for defaults, contradictions refused naming the key."""

import pytest

from trainer.config import VLLM_INSTALL, ConfigError, PPOConfig, config_to_dict, flatten, load_config, rollout_name

BASE = "configs/tiny_cpu.yaml"


def test_defaults_and_overrides():
    cfg = load_config(
        BASE, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.kl_ctrl.kl_coef=0.05"]
    )
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.05
    assert cfg.data.train_batch_size == 16  # from the file


def test_every_design_key_exists():
    keys = set(flatten(config_to_dict(PPOConfig())))
    for key in [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
        "actor_rollout_ref.actor.fsdp_config.offload_policy",
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "actor_rollout_ref.model.enable_activation_offload",
        "actor_rollout_ref.model.use_remove_padding",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "actor_rollout_ref.rollout.max_num_seqs",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.rollout.n",
        "critic.ppo_micro_batch_size_per_gpu",
        "critic.ppo_max_token_len_per_gpu",
        "critic.forward_max_token_len_per_gpu",
        "algorithm.gamma",
        "algorithm.lam",
        "algorithm.use_kl_in_reward",
        "algorithm.kl_penalty",
        "algorithm.kl_ctrl.type",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_ctrl.target_kl",
        "algorithm.kl_ctrl.horizon",
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "data.train_files",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "trainer.total_training_steps",
    ]:
        assert key in keys, key


@pytest.mark.parametrize(
    "override, key",
    [
        (
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        ),
        ("critic.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size"),
        ("actor_rollout_ref.actor.bogus_knob=1", "actor_rollout_ref.actor.bogus_knob"),
        ("data.train_batch_size=many", "data.train_batch_size"),
        ("actor_rollout_ref.model.use_remove_padding=3", "actor_rollout_ref.model.use_remove_padding"),
        ("actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.strategy"),
        ("algorithm.kl_penalty=k9", "algorithm.kl_penalty"),
        (
            "actor_rollout_ref.actor.fsdp_config.offload_policy=true",
            "actor_rollout_ref.actor.fsdp_config.offload_policy",
        ),
        (
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype",
        ),
        ("critic.fsdp.mixed_precision.reduce_dtype=int8", "critic.fsdp.mixed_precision.reduce_dtype"),
        ("actor_rollout_ref.ref.fsdp_config.model_dtype=fp8", "actor_rollout_ref.ref.fsdp_config.model_dtype"),
        ("critic.fsdp.fsdp_size=3", "critic.fsdp.fsdp_size"),
        ("actor_rollout_ref.actor.fsdp_config.fsdp_size=0", "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
        (
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        ),
        (
            "actor_rollout_ref.actor.entropy_from_logits_chunk_size=0",
            "actor_rollout_ref.actor.entropy_from_logits_chunk_size",
        ),
        ("actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", "actor_rollout_ref.actor.fsdp_config.dtype"),
        (
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
        ),
        ("actor_rollout_ref.rollout.max_model_len=64", "actor_rollout_ref.rollout.max_model_len"),
        ("actor_rollout_ref.rollout.max_num_seqs=0", "actor_rollout_ref.rollout.max_num_seqs"),
        ("actor_rollout_ref.rollout.dtype=fp8", "actor_rollout_ref.rollout.dtype"),
        ("ppotune.vllm_cpu_memory_gb=0", "ppotune.vllm_cpu_memory_gb"),
        ("actor_rollout_ref.model.path=/nonexistent/model", "actor_rollout_ref.model.path"),
        ("data.train_files=/nonexistent/train.parquet", "data.train_files"),
    ],
)
def test_refused_with_the_key_named(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(BASE, [override])
    msg = str(e.value)
    assert key in msg and BASE in msg and "\n" not in msg


def test_vllm_scheduler_limits_are_refused_as_vllm_refuses_them():
    """vLLM's start-up checks, made before launch: one token per running sequence, and without chunked
    prefill a whole sequence (prompt 64 + response 32 in the base) in one scheduler step."""
    key = "actor_rollout_ref.rollout."
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 32 is below max_num_seqs=64"):
        load_config(BASE, [f"{key}max_num_batched_tokens=32", f"{key}max_num_seqs=64"])
    with pytest.raises(ConfigError, match="max_num_batched_tokens: 64 is below max_model_len=96"):
        load_config(
            BASE, [f"{key}max_num_batched_tokens=64", f"{key}max_num_seqs=8", f"{key}enable_chunked_prefill=false"]
        )
    # chunked prefill splits the prompt: the same budget is fine
    load_config(BASE, [f"{key}max_num_batched_tokens=64", f"{key}max_num_seqs=8"])


def test_token_budget_below_one_sequence_is_refused():
    with pytest.raises(ConfigError, match="ppo_max_token_len_per_gpu: 50 is below"):
        load_config(
            BASE,
            ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50"],
        )


def test_divisibility_depends_on_world_size():
    load_config(
        BASE,
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.n_gpus_per_node=1",
            "critic.ppo_micro_batch_size_per_gpu=8",
        ],
    )
    with pytest.raises(ConfigError, match="per-GPU mini-batch"):
        load_config(BASE, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])  # 2 GPUs: 4 per GPU


def test_malformed_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: config: malformed YAML"):
        load_config(bad)


def test_check_command_validates_without_launching():
    import subprocess
    import sys

    ok = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "check", BASE, "--nproc", "2"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "mini-batch 4 sequences per GPU, 2 sequences per micro-batch" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "check", BASE, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: 3 does not divide" in bad.stderr


def test_precision_defaults_are_verls_and_old_keys_say_what_replaced_them():
    cfg = load_config(None)
    for fc in (cfg.actor_rollout_ref.actor.fsdp_config, cfg.actor_rollout_ref.ref.fsdp_config, cfg.critic.fsdp):
        mp = fc.mixed_precision
        assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype, fc.model_dtype) == ("bf16", "fp32", "fp32", "fp32")
    assert cfg.actor_rollout_ref.actor.use_torch_compile is True
    with pytest.raises(ConfigError, match="mixed_precision.param_dtype"):
        load_config(BASE, ["critic.fsdp.dtype=float32"])
    with pytest.raises(ConfigError, match="loss scaling"):
        load_config(BASE, ["critic.fsdp.mixed_precision.param_dtype=float16"])
    # verl's long spellings are accepted too
    load_config(BASE, ["critic.fsdp.mixed_precision.param_dtype=bfloat16", "critic.fsdp.model_dtype=float32"])


def test_hybrid_shard_size_must_divide_the_world():
    load_config(BASE, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "critic.fsdp.fsdp_size=2"])
    load_config(BASE, ["critic.fsdp.fsdp_size=-1"])


@pytest.mark.parametrize(
    ("named", "device", "vllm", "expected"),
    [
        ("hf", "cuda", False, "hf"),  # named: the config's, wherever it runs
        ("vllm", "cpu", False, "vllm"),
        (None, "cpu", False, "hf"),  # the CPU demo's
        (None, "cpu", True, "hf"),
        (None, "cuda", True, "vllm"),  # a GPU trial runs what verl runs
    ],
)
def test_the_rollout_a_run_takes(named, device, vllm, expected):
    assert rollout_name(named, device_type=device, vllm_importable=vllm) == expected


def test_a_gpu_run_without_a_named_rollout_and_without_vllm_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        rollout_name(None, device_type="cuda", vllm_importable=False, source="job.yaml")
    line = str(e.value)
    assert "\n" not in line and line.startswith("job.yaml: actor_rollout_ref.rollout.name: ")
    assert VLLM_INSTALL in line and "hf" in line


def test_the_default_rollout_is_not_named():
    assert PPOConfig().actor_rollout_ref.rollout.name is None
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.name"):
        load_config(BASE, ["actor_rollout_ref.rollout.name=sglang"])
