"""The prepared GPU script: nccl, bf16 mixed precision (verl's default), every offload combination on
both strategies, the linear-memory attention path, per-phase memory, a real CUDA OOM, NVML, MFU, and
the colocated vLLM rollout (sleep/wake, weight push; skipped, saying so, where vLLM is not importable).
Skipped without a CUDA device; never needed in CI (its plan is: tests/test_gpu_check.py).

:data:`PLAN` is what ``scripts/gpu_check.sh`` runs, in order, within :data:`BUDGET_S` of GPU time: the profile at
the realistic shape first (the question the next loan must answer), then correctness (the invariance suite on
CUDA, activation offload included), then the rest; each group's estimate and limit are printed before it starts and
each test's outcome as it ends, so a timeout keeps what finished. The estimates come from the first H200 run
(docs/gpu.md, its groups' times) and, for the realistic shape (not run yet), from its size; each group's limit is its
own share of the budget (:func:`group_limits`), so one group's overrun costs no other group its time.

Under the script each test writes as it runs under the logs folder it is given (:data:`LOGS_ENV`): its temporary
folder is made there and its subprocesses stream their output into log files in it (:func:`_logged`), so a test
stopped by its group's limit leaves what it had printed, and the runner prints those logs' last lines.

Run on a GPU machine with either of:
    python -m pytest tests/trainer/engine/test_gpu.py -v -s
    python tests/trainer/engine/test_gpu.py [NAME ...]  # no pytest plugins needed: every test (or those whose name
                                                 # holds a NAME), each outcome as it ends, a summary
    python tests/trainer/engine/test_gpu.py --plan      # the groups, their estimates and limits, against the budget
    python tests/trainer/engine/test_gpu.py --group NAME
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[3])]
from invariance import (  # noqa: E402
    BIT_FOR_BIT,
    CHECKS_BF16,
    CHECKS_FP32,
    TOL,
    VARIANTS_1,
    VARIANTS_2,
    VARIANTS_BF16_2,
    VARIANTS_GRPO_2,
    bit_differences,
    caught_failures,
    run_variants_caught,
    table,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
#: GPU time the whole check may take (scripts/gpu_check.sh): a 15-minute device loan less its start-up, the
#: transfers and a rerun's margin
BUDGET_S = 360
#: (group, estimated seconds, tests) in the order scripts/gpu_check.sh runs them: the profile at the realistic
#: shape, then correctness, then the rest
PLAN = [
    ("1_profile", 150, ["test_profiled_step_at_a_realistic_shape"]),
    ("2_correctness", 95, ["test_invariance_on_cuda"]),
    (
        "3_rest",
        80,
        [
            "test_e2e_nccl",
            "test_packed_attention_memory_is_linear_on_cuda",
            "test_real_cuda_oom_under_the_cap",
            "test_nvml_sees_the_device",
            "test_vllm_rollout_colocated",
        ],
    ),
]
#: The folder the runner makes each test's temporary folder in (scripts/gpu_check.sh sets it to a folder under its
#: logs): a test's files, its subprocesses' streamed logs included, outlive a test stopped by its group's limit.
#: Unset, the runner makes them under the system's temporary folder.
LOGS_ENV = "PPOTUNE_GPU_LOGS"
#: Not in the plan: run by name (``python tests/trainer/engine/test_gpu.py NAME``) when a loan has time left
EXTRA = [
    "test_offload_cost_at_a_realistic_shape",
    "test_every_offload_combination_bf16",
    "test_mfu_half_b_shape",
    "test_search_on_gpu",
]
ROOT = Path(__file__).resolve().parents[3]
BASE = str(ROOT / "configs" / "tiny_cpu.yaml")
# Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads), built from config.
HALF_B = [
    "ppotune.tiny.hidden_size=896",
    "ppotune.tiny.num_hidden_layers=24",
    "ppotune.tiny.num_attention_heads=14",
    "ppotune.tiny.num_key_value_heads=2",
    "ppotune.tiny.intermediate_size=4864",
]
# verl's default compute dtype (the CPU demo config computes in fp32)
BF16 = {
    f"{s}.mixed_precision.param_dtype": "bf16"
    for s in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")
}
# Wide enough that parameters and optimizer state show in the per-phase memory.
WIDE = {
    "ppotune.tiny.hidden_size": 1024,
    "ppotune.tiny.num_hidden_layers": 4,
    "ppotune.tiny.num_attention_heads": 16,
    "ppotune.tiny.num_key_value_heads": 4,
    "ppotune.tiny.intermediate_size": 4096,
    "actor_rollout_ref.actor.use_torch_compile": True,
}


def _logged(tmp_path: Path, stem: str, cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output streamed, as it runs, to a new ``tmp_path/<stem>-<n>.log``; -> the finished
    process, its output read back as ``stdout`` (``stderr`` is in it). Streamed rather than captured: a test stopped
    by its group's limit leaves the log (the runner prints its last lines)."""
    n = 1 + sum(1 for _ in tmp_path.glob(f"{stem}-*.log"))
    log = tmp_path / f"{stem}-{n}.log"
    with log.open("w") as f:
        returncode = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    return subprocess.CompletedProcess(cmd, returncode, stdout=log.read_text(errors="replace"), stderr="")


def _train(tmp_path, *args):
    result = tmp_path / f"r{1 + sum(1 for _ in tmp_path.glob('r*.json'))}.json"
    cmd = [sys.executable, "-m", "tuner.cli", "train", BASE, "ppotune.device=cuda", *map(str, args)]
    proc = _logged(tmp_path, "train", [*cmd, "--result", str(result)])
    # a run that wrote no result (it crashed before) says what it printed, not a missing file's name
    assert result.is_file(), f"no result (exit {proc.returncode}): {proc.stdout[-3000:]}"
    return proc, json.loads(result.read_text())


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_e2e_nccl(tmp_path, strategy):
    n = torch.cuda.device_count()
    proc, r = _train(
        tmp_path,
        f"actor_rollout_ref.actor.strategy={strategy}",
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
    # the demo config packs rows (use_remove_padding) and computes in fp32: flash-attn cannot run it (flex attention
    # does), and the result says so (trainer.engine.knob_notes.packed_attention_notes), where a CPU run says nothing
    assert any(
        n.startswith("actor_rollout_ref.model.use_remove_padding: packed attention ran torch's flex attention")
        for n in r["notes"]
    ), r["notes"]
    # the demo config names the HF rollout: not production's on a GPU, and the result says so
    assert any(n.startswith("actor_rollout_ref.rollout.name=hf: HF generate on a GPU") for n in r["notes"])
    print(strategy, r["summary"]["throughput"], r["summary"]["peak_memory_reserved_gb"])
    last = r["steps"][-1]
    print("per-phase peak GB:", {k[7:-3]: round(v, 3) for k, v in last.items() if k.startswith("memory/")})


def test_every_offload_combination_bf16(tmp_path):
    """verl's offload flags x fsdp/fsdp2, bf16 mixed precision: all run, and the per-phase memory shows them act."""
    from step_worker import offload_matrix, refusal, run_step_worker

    variants = {k: {**v, **WIDE} for k, v in offload_matrix().items() if refusal(v) is None}
    got = run_step_worker(tmp_path, variants, nproc=torch.cuda.device_count(), env={"PPOTUNE_TEST_DEVICE": "cuda"})
    print(f"{'variant':45s} " + " ".join(f"{p:>13s}" for p in next(iter(got.values()))["memory_gb"]))
    world = torch.cuda.device_count()
    for name, r in got.items():
        assert r["status"] == "ok", (name, r.get("error"))
        print(f"{name:45s} " + " ".join(f"{v:13.3f}" for v in r["memory_gb"].values()))
        print(f"{'':45s} left allocated {r['leftover_allocated_gb']:.3f} GB; collectives {r['collective_events']}")
        # 4 blocks + root, once each; one rank shards nothing (FSDP1 runs NO_SHARD): no gather to count
        if world > 1:
            assert r["gathers_per_generate"] == 5, (name, r["gathers_per_generate"])
        # the models of one variant are gone before the next builds (no leak across variants)
        assert r["leftover_allocated_gb"] < 0.05, (name, r["leftover_allocated_gb"])
    for strategy in ("fsdp", "fsdp2"):
        base, off = got[f"{strategy}-none"]["memory_gb"], got[f"{strategy}-param_offload"]["memory_gb"]
        # while the reference model runs, the offloaded actor and critic are in host memory
        assert off["ref"] < base["ref"], (strategy, off["ref"], base["ref"])


def test_packed_attention_memory_is_linear_on_cuda():
    """Forward+backward over a packed micro-batch: 4x tokens -> well under 16x peak memory (exact CUDA stats)."""
    from trainer.config import TinyModelConfig
    from trainer.engine.models import build_tokenizer, load_actor
    from trainer.engine.step import assemble_batch, forward_response

    tok = build_tokenizer()
    seq = 1024
    model = load_actor("tiny", tok, tiny=TinyModelConfig(), max_positions=seq).cuda()

    def peak(n_seqs: int) -> float:
        ids = torch.randint(5, len(tok), (n_seqs, seq // 2), device="cuda")
        ones = torch.ones_like(ids)
        batch = assemble_batch(ids, ones, ids.clone(), ones.clone())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward_response(model, batch, kind="actor", rmpad=True, prompt_width=seq // 2)
        out["log_prob"].sum().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    small, large = peak(4), peak(16)
    print(f"packed fwd+bwd peak: {4 * seq} tokens {small:.1f} MiB, {16 * seq} tokens {large:.1f} MiB")
    print(f"ratio {large / small:.2f} for 4x the tokens")
    assert large / small < 6


def test_real_cuda_oom_under_the_cap(tmp_path):
    proc, r = _train(tmp_path, *HALF_B, "--nproc", 1, "--steps", 1, "--memory-limit-gb", 1.0)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["status"] == "oom" and "out of memory" in r["error"].lower()


def test_mfu_half_b_shape(tmp_path):
    """The actor update's MFU on the 0.5B shape in verl's bf16, with the step's time by phase and the
    operators of one profiled step (the step of a GPU trial was overhead-bound on the first H200 run)."""
    # 3 steps: warm-up, profiled, measured (a bf16 step of this shape is slow: docs/gpu.md)
    bf16 = [f"{k}={v}" for k, v in BF16.items()]
    proc, r = _train(tmp_path, *HALF_B, *bf16, "--nproc", 1, "--steps", 3, "--warmup", 1, "--profile-step", 2)
    print(proc.stdout[proc.stdout.find("profile of step") :][:6000])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mfu = r["summary"]["mfu"]
    print(f"MFU (actor update, 0.5B shape, bf16, {r['environment']['device_name']}): {mfu}")
    timing = {k: round(v, 3) for k, v in r["summary"]["timing_s"].items()}
    step, thr = r["summary"]["step_s"], r["summary"]["throughput"]
    print(f"step {step:.3f} s, throughput {thr:.0f} tokens/s/GPU; by phase: {timing}")
    assert mfu is not None and 0 < mfu < 1


# Qwen2.5-0.5B's shape, vocabulary and tied embeddings included (random weights): issue 24's realistic shape
QWEN05B = dict(
    vocab_size=151936,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=2048,
)
TOKEN_BUDGET = 16384


def _qwen05b_checkpoint(path: Path) -> Path:
    """A Qwen2.5-0.5B-shaped checkpoint (bf16 on disk, ~1 GB) and a tokenizer as large as its vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.engine.models import build_tokenizer

    tok = build_tokenizer(vocab_size=QWEN05B["vocab_size"])
    cfg = Qwen2Config(**QWEN05B, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, use_cache=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _realistic(ckpt: Path, *extra) -> list[str]:
    """The overrides of the realistic shape: 64 prompts, 512-token responses (EOS ignored), bf16, every pass
    under a 16384-token budget per GPU, 4 mini-batches per update."""
    over = {
        "actor_rollout_ref.model.path": ckpt,
        "critic.model.path": ckpt,
        "data.train_batch_size": 64,
        "data.max_prompt_length": 128,
        "data.max_response_length": 512,
        "actor_rollout_ref.rollout.ignore_eos": True,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": TOKEN_BUDGET,
        "critic.ppo_max_token_len_per_gpu": TOKEN_BUDGET,
        "actor_rollout_ref.actor.use_torch_compile": True,
        **BF16,
    }
    return [f"{k}={v}" for k, v in over.items()] + list(extra)


def _host_device_gbps(gib: int = 1) -> tuple[float, float]:
    """Measured pinned host-to-device and device-to-host bandwidth, GB/s."""
    host = torch.empty(gib * 2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out.append(3 * host.numel() / (start.elapsed_time(end) / 1e3) / 1e9)
    return out[0], out[1]


def test_profiled_step_at_a_realistic_shape(tmp_path):
    """Issue 24's GPU profile: a Qwen2.5-0.5B-shaped model (random weights, its real vocabulary), bf16, a
    16384-token budget per GPU in every pass, 64 prompts with 512-token responses. One profiled step (its HF
    generate recorded over its first decode steps: trainer.engine.metrics.PROFILED_DECODE_STEPS), per phase: wall
    time against device-busy time, kernel launches, syncs, the top host ranges; then MFU per phase from a measured
    step. Goals (printed, not asserted): update_actor MFU >= 35 %, device busy >= 80 % of wall in the update phases."""
    ckpt = _qwen05b_checkpoint(tmp_path / "qwen05b")
    proc, r = _train(tmp_path, *_realistic(ckpt), "--nproc", 1, "--steps", 3, "--warmup", 1, "--profile-step", 2)
    print(proc.stdout[proc.stdout.find("profile of step 2 by phase") :][:4000], flush=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    prof, last = r["steps"][1], r["steps"][-1]
    print(f"realistic shape, {r['environment']['device_name']}: {last['perf/total_num_tokens']} tokens per step")
    print(f"{'phase':<15}{'wall s':>8}{'busy %':>8}{'launches':>10}{'syncs':>7}{'MFU %':>8}")
    for phase in ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor"):
        wall = prof.get(f"profile/{phase}/wall_ms", 0.0)
        busy = 100 * prof.get(f"profile/{phase}/device_busy_ms", 0.0) / wall if wall else 0.0
        mfu = last.get(f"perf/mfu/{phase}")
        print(
            f"{phase:<15}{last[f'timing_s/{phase}']:>8.2f}{busy:>8.1f}{prof.get(f'profile/{phase}/launches', 0):>10}"
            f"{prof.get(f'profile/{phase}/syncs', 0):>7}{100 * mfu if mfu else float('nan'):>8.1f}",
            flush=True,
        )
    print(f"goal update_actor MFU >= 35 %: {100 * (last.get('perf/mfu/update_actor') or 0):.1f} %")
    print("notes:", *r["notes"], sep="\n  ")
    peaks = {k[7:-3]: round(v, 2) for k, v in last.items() if k.startswith("memory/")}
    print("per-phase peak GB (against tuner.memory_model's terms):", peaks)


def test_offload_cost_at_a_realistic_shape(tmp_path):
    """The realistic shape with param_offload + optimizer_offload against without: each phase's extra time against
    the bytes it moves over the measured pinned bandwidth (goal, printed: within 1.2x of bytes / bandwidth)."""
    ckpt = _qwen05b_checkpoint(tmp_path / "qwen05b")
    proc, r = _train(tmp_path, *_realistic(ckpt), "--nproc", 1, "--steps", 2, "--warmup", 1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    h2d, d2h = _host_device_gbps()
    offload = [
        f"{s}.{k}=true"
        for s in ("actor_rollout_ref.actor.fsdp_config", "critic.fsdp")
        for k in ("param_offload", "optimizer_offload")
    ]
    proc2, r2 = _train(tmp_path, *_realistic(ckpt, *offload), "--nproc", 1, "--steps", 2, "--warmup", 1)
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    params = r["model"]["num_params"] * 4  # fp32 master shards, one GPU
    moved = {  # bytes each phase moves in and out (parameters; + Adam's two moments in an update)
        "gen": 2 * params,
        "old_log_prob": 2 * params,
        "values": 2 * params,
        "update_critic": 2 * params + 4 * params,
        "update_actor": 2 * params + 4 * params,
    }
    print(f"pinned bandwidth: host->device {h2d:.1f} GB/s, device->host {d2h:.1f} GB/s")
    base, off = r["steps"][-1], r2["steps"][-1]
    for phase, nbytes in moved.items():
        extra = off[f"timing_s/{phase}"] - base[f"timing_s/{phase}"]
        ideal = nbytes / 2 / (h2d * 1e9) + nbytes / 2 / (d2h * 1e9)
        print(f"offload {phase:<14} extra {extra:6.2f} s, bytes/bandwidth {ideal:6.2f} s ({extra / ideal:4.2f}x)")


def test_invariance_on_cuda(tmp_path):
    """The CPU suite's variants and checks on CUDA ranks (nccl), where the offload knobs really move tensors.
    fp32 within 10x the CPU tolerance: cuBLAS picks its kernels by shape, so another micro-batch split may
    sum in another order even with TF32 off; bf16 within the same tolerances as on CPU."""
    n, env = torch.cuda.device_count(), {"PPOTUNE_TEST_DEVICE": "cuda"}
    # each variant caught alone: one that fails is reported and the launch goes on from the next
    got, missing = run_variants_caught(n, tmp_path, {**VARIANTS_2, **VARIANTS_BF16_2, **VARIANTS_GRPO_2}, env=env)
    got1, missing1 = run_variants_caught(1, tmp_path, VARIANTS_1, env=env)
    got, missing = {**got, **got1}, {**missing, **missing1}
    print(f"invariance: {len(got)} of {len(got) + len(missing)} variants ran", flush=True)
    found = [f"{variant} FAILED: {why}" for variant, why in missing.items()]
    checks = CHECKS_FP32 + CHECKS_BF16
    try:
        print(table(got, [c for c in checks if c.variant in got and c.reference in got]), flush=True)
    except Exception as exc:  # noqa: BLE001 - the checks below still report one by one
        found.append(f"the table of differences raised {type(exc).__name__}: {exc}")
    gpu_exact = dataclasses.replace(CHECKS_FP32[0].tol, params=10 * TOL, grads=10 * TOL)
    found += [f for c in CHECKS_FP32 for f in caught_failures(got, missing, dataclasses.replace(c, tol=gpu_exact))]
    found += [f for c in CHECKS_BF16 for f in caught_failures(got, missing, c)]
    # offload moves tensors and changes no arithmetic: the same bits (but offload_policy, whose optimizer step runs
    # on the CPU, rounds otherwise)
    for variant, reference in BIT_FOR_BIT:
        if "offload_policy" in variant:
            continue
        if variant not in got or reference not in got:
            found.append(f"bit for bit {variant} vs {reference}: not compared (a variant has no result)")
            continue
        differing = bit_differences(got, variant, reference)
        print(f"bit for bit {variant} vs {reference}: {len(differing)} tensors differ", flush=True)
        found += [f"{variant} vs {reference}: {d} differs" for d in differing[:3]]
    for variant in (v for v in VARIANTS_2 if "activation_offload" in v):
        if variant in got and not got[variant]["activation_offload_ran"]:
            found.append(f"{variant}: the activation offload hooks did not run")
    assert not found, "\n".join(found)


def _vllm_importable() -> str | None:
    """None when vLLM imports here; else why not (the lent GPU machine usually has no vLLM)."""
    r = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    return None if r.returncode == 0 else ((r.stderr.strip().splitlines() or ["?"])[-1])


@pytest.mark.parametrize("free_cache_engine", [True, False])
def test_vllm_rollout_colocated(tmp_path, free_cache_engine):
    """A real CUDA vLLM engine per rank next to the FSDP actor: bf16, sleep level 2 around training
    (free_cache_engine), weights pushed every step; the gen phase's memory includes the engine."""
    why = _vllm_importable()
    if why is not None:
        pytest.skip(f"vLLM is not importable on this device ({why}): the vLLM rollout was not run on a GPU")
    n = torch.cuda.device_count()
    proc, r = _train(
        tmp_path,
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        f"actor_rollout_ref.rollout.free_cache_engine={str(free_cache_engine).lower()}",
        *[f"{k}={v}" for k, v in WIDE.items()],
        "--nproc",
        n,
        "--steps",
        3,
        "--warmup",
        1,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["status"] == "ok" and r["summary"]["timing_s"]["update_weights"] > 0
    last = r["steps"][-1]
    phases = {k[7:-3]: round(v, 3) for k, v in last.items() if k.startswith("memory/")}
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1024**3
    # awake, the engine holds about 0.3 x the device: the gen phase sees it
    assert phases["gen"] >= 0.25 * total_gb, phases
    if free_cache_engine:  # asleep during training: the update phases get the memory back
        assert phases["update_actor"] < phases["gen"] - 0.1 * total_gb, phases
    print(f"free_cache_engine={free_cache_engine}", "per-phase GB:", phases, "timing:", r["summary"]["timing_s"])


def test_search_on_gpu(tmp_path):
    """A real ppotune search on the GPU (a 1024-wide model, verl's bf16): warm trials on nccl, the memory
    objective from NVML, the memory model fitted on GPU peaks, the confirmation and the export; the same
    config measured again later in the warm job reads the same peak (nothing left behind by earlier trials).
    Skipped, saying so, where optuna is not importable (the lent GPU machine has none unless carried)."""
    import yaml

    from trainer.config import apply_overrides, read_yaml_mapping

    if subprocess.run([sys.executable, "-c", "import optuna"], capture_output=True).returncode:
        pytest.skip("optuna is not importable on this device: no search was run on a GPU")
    over = {
        **{k: v for k, v in WIDE.items() if k.startswith("ppotune.tiny.")},
        "ppotune.device": "cuda",
        "trainer.n_gpus_per_node": 1,
        **BF16,
    }
    base = tmp_path / "gpu.yaml"
    base.write_text(yaml.safe_dump(apply_overrides(read_yaml_mapping(BASE), over)))
    out = tmp_path / "out"
    space = ROOT / "search_spaces" / "tiny_cpu.yaml"
    cmd = [sys.executable, "-m", "tuner.cli", "search", str(base), "--space", str(space), "--report"]
    cmd += ["--trials", "6", "--nproc", "1", "--steps", "5", "--confirm", "1", "--probe", "1", "--out", str(out)]
    # the search's console goes straight to this test's output: a slow run still shows how far it got
    assert subprocess.run(cmd, cwd=ROOT, timeout=600).returncode == 0
    import optuna

    study = optuna.load_study(study_name=None, storage=f"sqlite:///{out / 'study.db'}")
    measured = [t for t in study.get_trials() if t.user_attrs.get("status") == "ok"]
    assert measured, [t.user_attrs.get("status") for t in study.get_trials()]
    for t in measured:
        mem = {k: round(v, 3) if isinstance(v, float) else v for k, v in t.user_attrs["memory"].items()}
        print(f"trial {t.number} (confirms {t.user_attrs.get('confirm_of')}): {t.values} {mem}")
        assert t.user_attrs["memory_source"] == "nvml" and mem["external_peak_gb"] > 0, (t.number, mem)
        phases = mem.get("by_phase_gb") or {}
        assert len(set(phases.values())) > 1, phases  # the phases' own peaks differ (not the cache's)
    peaks = {t.number: t.values[1] for t in measured}
    speeds = {t.number: t.values[0] for t in measured}
    for t in measured:
        first = t.user_attrs.get("confirm_of")
        if first in peaks:  # the same config again, later in the warm job
            assert abs(peaks[t.number] - peaks[first]) <= 0.05 * peaks[first] + 0.05, (t.number, first, peaks)
            # warm-trial drift (issue 24): the same config's throughput later in the job, against its first
            print(f"drift: trial {t.number} repeats trial {first}: {speeds[t.number] / speeds[first]:.2f}x throughput")
    exp = subprocess.run([sys.executable, "-m", "tuner.cli", "export", "--out", str(out)], cwd=ROOT)
    assert exp.returncode == 0
    print((out / "why.md").read_text()[:2500])


def test_nvml_sees_the_device():
    pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed here")

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total > 0


def _tests(wanted: list[str]) -> list[tuple[str, object]]:
    """This module's tests whose name holds one of ``wanted`` (every test when empty), in file order."""
    tests = [(k, v) for k, v in list(globals().items()) if k.startswith("test_") and callable(v)]
    return [(k, v) for k, v in tests if not wanted or any(w in k for w in wanted)]


def group_limits(plan=PLAN, budget_s: int = BUDGET_S) -> list[tuple[str, int, int, int]]:
    """(group, estimate_s, limit_s, deadline_s) of each group of ``plan``, from the plan alone.

    A group's limit is its reserved share of the budget: its estimate scaled by ``budget_s / (sum of estimates)``,
    rounded down, so the limits never sum past the budget. Its deadline (seconds from the first group's start) is
    the sum of its limit and every earlier group's. scripts/gpu_check.sh stops each group at its deadline: a group
    that overruns spends its own limit and is stopped there, so no later group's share is touched, while the time
    an earlier group left over passes on to the next.
    """
    total = sum(est for _, est, _ in plan)
    out, deadline = [], 0
    for group, est, _ in plan:
        limit = est * budget_s // total if total else 0
        deadline += limit
        out.append((group, est, limit, deadline))
    return out


def plan_problems() -> list[str]:
    """What is wrong with :data:`PLAN`: over :data:`BUDGET_S`, a name that is no test here, a test in two groups."""
    problems = []
    total = sum(est for _, est, _ in PLAN)
    if total > BUDGET_S:
        problems.append(f"the plan's estimates sum to {total} s, over the {BUDGET_S} s budget")
    seen: dict[str, str] = {}
    for group, _, names in PLAN:
        for name in names:
            if name not in globals() or not name.startswith("test_"):
                problems.append(f"{group}: {name} is no test of this file")
            elif name in seen:
                problems.append(f"{name} is in {seen[name]} and {group}")
            seen.setdefault(name, group)
    problems += [f"{name} (EXTRA) is no test of this file" for name in EXTRA if name not in globals()]
    left = [name for name, _ in _tests([]) if name not in seen and name not in EXTRA]
    problems += [f"{name} is in neither the plan nor EXTRA" for name in left]
    return problems


def print_plan() -> int:
    """The groups as scripts/gpu_check.sh reads them (``group NAME ESTIMATE_S LIMIT_S DEADLINE_S TEST...``), the
    totals, then what is left out."""
    print("# group NAME ESTIMATE_S LIMIT_S DEADLINE_S TESTS: the limit is the group's share of the budget (its")
    print("# estimate scaled to it), the deadline is from the first group's start; a group gets until its deadline")
    limits = group_limits()
    for (group, est, limit, deadline), (_, _, names) in zip(limits, PLAN, strict=True):
        print(f"group {group} {est} {limit} {deadline} {' '.join(names)}")
    total, reserved = sum(est for _, est, _ in PLAN), sum(limit for _, _, limit, _ in limits)
    print(f"total {total} s estimated, {reserved} s of limits, of a {BUDGET_S} s budget")
    print("not in the plan (run by name when a loan has time left):", " ".join(EXTRA))
    problems = plan_problems()
    for p in problems:
        print(f"plan: {p}")
    return 2 if problems else 0


def _test_folder(label: str) -> Path:
    """A new temporary folder for the test ``label``: under :data:`LOGS_ENV`'s folder when it is set."""
    import tempfile

    base = os.environ.get(LOGS_ENV)
    if base:  # absolute: the test's subprocesses may run from another folder
        base = str(Path(base).resolve())
        Path(base).mkdir(parents=True, exist_ok=True)
    # only letters, digits, '.', '_' and '-' in the name: a parametrized test's brackets would not travel back
    return Path(tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9._-]", "_", label) + "-", dir=base or None))


def _print_log_tails(folder: Path, lines: int = 25) -> None:
    """The last ``lines`` lines of every log under ``folder``: what a test stopped by its limit had got to."""
    for log in sorted(folder.rglob("*.log"), key=lambda p: p.stat().st_mtime):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"----- the last {len(tail)} lines of {log}:", *tail, sep="\n", flush=True)


def run_tests(tests) -> int:
    """Run ``tests`` (name, function), each outcome printed as it ends; an interrupt (a timeout's SIGINT) stops
    the run, the interrupted test's logs' last lines are printed and the summary still says what finished."""
    import time
    import traceback

    results = {}
    try:
        for name, fn in tests:
            marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
            argname, values = (marks[0].args[0], marks[0].args[1]) if marks else (None, [None])
            for value in values:
                label = f"{name}[{value}]" if argname else name
                print(f"===== {label}", flush=True)
                kwargs = {argname: value} if argname else {}
                folder = None
                if "tmp_path" in fn.__code__.co_varnames[: fn.__code__.co_argcount]:
                    kwargs["tmp_path"] = folder = _test_folder(label)
                    print(f"----- {label} writes under {folder}", flush=True)
                start = time.monotonic()
                try:
                    fn(**kwargs)
                    results[label] = f"PASS ({time.monotonic() - start:.0f} s)"
                except KeyboardInterrupt:
                    results[label] = f"INTERRUPTED ({time.monotonic() - start:.0f} s)" + (
                        f" its files: {folder}" if folder else ""
                    )
                    if folder:
                        _print_log_tails(folder)
                    raise
                except BaseException as exc:  # noqa: BLE001 - report every test, then the summary
                    if type(exc).__name__ == "Skipped":
                        results[label] = f"SKIP {exc}"
                    else:
                        traceback.print_exc()
                        results[label] = (
                            f"FAIL ({time.monotonic() - start:.0f} s) {type(exc).__name__}: {str(exc)[:300]}"
                        )
                print(f"----- {label}: {results[label][:300]}", flush=True)
    except KeyboardInterrupt:
        print("----- interrupted (the group's time ran out): the summary holds what finished", flush=True)
    print("===== summary", flush=True)
    for label, outcome in results.items():
        print(f"{outcome.split()[0]:5s} {label} {' '.join(outcome.split()[1:])[:300]}", flush=True)
    return 0 if results and all(o.startswith(("PASS", "SKIP")) for o in results.values()) else 1


if __name__ == "__main__":
    # A runner for a GPU machine without pytest's plugins or optuna.
    import argparse

    ap = argparse.ArgumentParser(description="the GPU checks without pytest")
    ap.add_argument("names", nargs="*", help="substrings of test names (all when none)")
    ap.add_argument("--plan", action="store_true", help="print the groups and check them against the budget")
    ap.add_argument("--group", help="run one group of the plan")
    cli = ap.parse_args()
    if cli.plan:
        sys.exit(print_plan())
    if not torch.cuda.is_available():
        sys.exit("test_gpu.py: no CUDA device visible; nothing to run")
    if cli.group:
        groups = {g: names for g, _, names in PLAN}
        if cli.group not in groups:
            sys.exit(f"test_gpu.py: no group {cli.group!r} in the plan ({', '.join(groups)})")
        selected = [(n, globals()[n]) for n in groups[cli.group]]
    else:
        selected = _tests(cli.names)
    sys.exit(run_tests(selected))
