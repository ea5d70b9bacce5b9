"""The invariance check's machinery (shared by engine/test_invariance.py and engine/test_gpu.py): the knob variants,
torchrun of the worker over them, and the comparison of parameters, gradients and statistics.

Each variant is a dict of config overrides on top of the worker's common ones (fp32 compute, a larger
learning rate). A :class:`Check` says which variant must reproduce which reference, and how closely.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torchrun import ROOT, torchrun

from trainer.config import FSDP_SECTIONS

WORKER = Path(__file__).resolve().parent / "invariance_worker.py"
TOL = 1e-5  # per-tensor relative difference ||a - b|| / ||b||, fp32: every knob is an exact no-op
ACTOR, CRITIC = "actor_rollout_ref.actor", "critic"


def _both(key: str, value) -> dict:
    """The same knob for the actor's and the critic's FSDP sections."""
    return {f"{ACTOR}.fsdp_config.{key}": value, f"{CRITIC}.fsdp.{key}": value}


def _all_sections(key: str, value) -> dict:
    return {f"{section}.{key}": value for section in FSDP_SECTIONS}


#: The worker's common overrides make every run fp32 (the default is verl's bf16 compute);
#: the bf16 variants put verl's default back.
BF16_COMPUTE = _all_sections("mixed_precision.param_dtype", "bf16")
MICRO_1 = {f"{ACTOR}.ppo_micro_batch_size_per_gpu": 1, f"{CRITIC}.ppo_micro_batch_size_per_gpu": 1}
DYNAMIC_96 = {
    f"{ACTOR}.use_dynamic_bsz": True,
    f"{ACTOR}.ppo_max_token_len_per_gpu": 96,
    f"{CRITIC}.ppo_max_token_len_per_gpu": 96,
}
FSDP2 = {f"{ACTOR}.strategy": "fsdp2"}  # the critic's strategy follows the actor's
CRITIC_MINI_4 = {f"{CRITIC}.ppo_mini_batch_size": 4}  # the actor's is 8 (configs/tiny_cpu.yaml), of 16
# The entropy of a random model is near its maximum, where its gradient is small: a coefficient of 1
# moves the actor's gradient by 6.8e-2 (measured; checked against the bf16 tolerance). Chunks of 7 tokens
# never line up with the micro-batches.
ENTROPY = {f"{ACTOR}.entropy_coeff": 1.0}
CHUNKED = {f"{ACTOR}.entropy_from_logits_with_chunking": True, f"{ACTOR}.entropy_from_logits_chunk_size": 7}
ENTROPY_CKPT = {f"{ACTOR}.entropy_checkpointing": True}
ACTIVATION_OFFLOAD = {
    "actor_rollout_ref.model.enable_activation_offload": True,
    f"{CRITIC}.model.enable_activation_offload": True,
}
CHECKPOINTING = {
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "critic.model.enable_gradient_checkpointing": True,
}
#: verl turns activation offload off below 3 layers (trainer/engine/offload.py::offload_layers): its variants and
#: their references run a 3-layer tiny model
LAYERS_3 = {"ppotune.tiny.num_hidden_layers": 3}

#: The fp32 knob variants (2 ranks) that must reproduce ``base`` exactly.
VARIANTS_2 = {
    "base": {},
    "micro_batch_1": MICRO_1,
    "micro_batch_4": {f"{ACTOR}.ppo_micro_batch_size_per_gpu": 4, f"{CRITIC}.ppo_micro_batch_size_per_gpu": 4},
    "dynamic_bsz_96": DYNAMIC_96,
    "dynamic_bsz_300": {
        f"{ACTOR}.use_dynamic_bsz": True,
        f"{ACTOR}.ppo_max_token_len_per_gpu": 300,
        f"{CRITIC}.ppo_max_token_len_per_gpu": 300,
    },
    "gradient_checkpointing": {
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "critic.model.enable_gradient_checkpointing": True,
    },
    "padded": {"actor_rollout_ref.model.use_remove_padding": False, "critic.model.use_remove_padding": False},
    "fsdp2": FSDP2,
    "param_offload": _both("param_offload", True),
    "optimizer_offload": _both("optimizer_offload", True),
    "param_and_optimizer_offload": {**_both("param_offload", True), **_both("optimizer_offload", True)},
    "fsdp2_offload_policy": {**FSDP2, **_both("offload_policy", True)},
    "forward_prefetch": _both("forward_prefetch", True),
    "fsdp2_forward_prefetch": {**FSDP2, **_both("forward_prefetch", True)},
    "no_reshard_after_forward": _both("reshard_after_forward", False),
    "fsdp2_no_reshard_after_forward": {**FSDP2, **_both("reshard_after_forward", False)},
    # one sequence per micro-batch: several micro-batches whose gradient reduce is skipped
    "no_sync": {**MICRO_1, **_both("use_no_sync_for_gradient_accumulation", True)},
    "fsdp2_no_sync": {**FSDP2, **MICRO_1, **_both("use_no_sync_for_gradient_accumulation", True)},
    # the forward-only passes (old and ref log-probs, values) cut into other micro-batches, or token budgets
    "forward_micro_batch_1": {
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
        f"{CRITIC}.forward_micro_batch_size_per_gpu": 1,
    },
    "dynamic_bsz_forward_96": {
        f"{ACTOR}.use_dynamic_bsz": True,
        f"{ACTOR}.ppo_max_token_len_per_gpu": 300,
        f"{CRITIC}.ppo_max_token_len_per_gpu": 300,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 96,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 96,
        f"{CRITIC}.forward_max_token_len_per_gpu": 96,
    },
    # saved activations to host memory and back (trainer.engine.offload.ActivationOffload: the worker asks for its
    # hooks on a CPU too), alone, on FSDP2, and with the recompute of gradient checkpointing
    "activation_offload": {**LAYERS_3, **ACTIVATION_OFFLOAD},
    "fsdp2_activation_offload": {**LAYERS_3, **FSDP2, **ACTIVATION_OFFLOAD},
    "activation_offload_checkpointing": {**LAYERS_3, **ACTIVATION_OFFLOAD, **CHECKPOINTING},
    "fsdp2_activation_offload_checkpointing": {**LAYERS_3, **FSDP2, **ACTIVATION_OFFLOAD, **CHECKPOINTING},
    # their references: the same knobs without activation offload
    "layers_3": LAYERS_3,
    "fsdp2_layers_3": {**LAYERS_3, **FSDP2},
    "layers_3_checkpointing": {**LAYERS_3, **CHECKPOINTING},
    "fsdp2_layers_3_checkpointing": {**LAYERS_3, **FSDP2, **CHECKPOINTING},
    # shard groups of one rank, replicated over the two (HSDP)
    "hybrid": _all_sections("fsdp_size", 1),
    "fsdp2_hybrid": {**FSDP2, **_all_sections("fsdp_size", 1)},
    # a different algorithm for the critic (more, smaller steps): reproduces one process, not base
    "critic_mini_4": CRITIC_MINI_4,
    # entropy bonus in the loss: a different algorithm for the actor, the reference of its knobs
    "entropy": ENTROPY,
    "entropy_chunked": {**ENTROPY, **CHUNKED},
    "entropy_checkpointing": {**ENTROPY, **ENTROPY_CKPT},
    "entropy_chunked_checkpointing_micro_1": {**ENTROPY, **CHUNKED, **ENTROPY_CKPT, **MICRO_1},
    # verl's default: the entropy function compiled (torch.compile)
    "entropy_compiled": {**ENTROPY, f"{ACTOR}.use_torch_compile": True},
}

#: A critic-free job (GRPO): no critic, advantages from the responses' scores grouped by prompt over the global
#: batch (8 responses per prompt: a group spans both ranks), the KL to the reference model as a loss (k1: its
#: gradient is not 0 at the first update, where actor and reference are the same), sequence-mean aggregation.
GRPO = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_in_reward": False,
    "actor_rollout_ref.rollout.n": 8,
    "data.train_batch_size": 2,
    f"{ACTOR}.ppo_mini_batch_size": 1,
    f"{ACTOR}.use_kl_loss": True,
    f"{ACTOR}.kl_loss_type": "k1",
    f"{ACTOR}.kl_loss_coef": 0.1,
    f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean",
}
#: GRPO under the key knobs (2 ranks): each must reproduce ``grpo_base``.
VARIANTS_GRPO_2 = {
    "grpo_base": GRPO,
    "grpo_micro_batch_1": {**GRPO, f"{ACTOR}.ppo_micro_batch_size_per_gpu": 1},
    "grpo_dynamic_bsz_96": {**GRPO, f"{ACTOR}.use_dynamic_bsz": True, f"{ACTOR}.ppo_max_token_len_per_gpu": 96},
    "grpo_param_and_optimizer_offload": {
        **GRPO,
        f"{ACTOR}.fsdp_config.param_offload": True,
        f"{ACTOR}.fsdp_config.optimizer_offload": True,
    },
    "grpo_gradient_checkpointing": {**GRPO, "actor_rollout_ref.model.enable_gradient_checkpointing": True},
    "grpo_fsdp2": {**GRPO, **FSDP2},
    # the KL loss acts: without it the update differs (see MUST_DIFFER)
    "grpo_no_kl_loss": {**GRPO, f"{ACTOR}.use_kl_loss": False},
}

#: verl's default compute dtype (bf16, fp32 master weights and gradient reduce), 2 ranks.
VARIANTS_BF16_2 = {
    "bf16_base": BF16_COMPUTE,
    "bf16_micro_batch_1": {**BF16_COMPUTE, **MICRO_1},
    "bf16_dynamic_bsz_96": {**BF16_COMPUTE, **DYNAMIC_96},
    "bf16_fsdp2": {**BF16_COMPUTE, **FSDP2},
}

#: One process: the world size is a per-GPU knob too.
VARIANTS_1 = {
    "one_process": {},
    "one_process_critic_mini_4": CRITIC_MINI_4,
    "bf16_one_process": BF16_COMPUTE,
    "grpo_one_process": GRPO,
}


@dataclass(frozen=True)
class Tolerance:
    """How closely a variant must reproduce its reference.

    ``per_tensor`` (fp32, exact): the worst tensor's ``||a - b|| / ||b||``, parameters relative to the
    weights. Otherwise (bf16, rounding noise) each model as one vector, and its parameters relative to
    the update ``||(a - init) - (b - init)|| / ||b - init||``: Adam's first steps are about ``lr * sign(g)``,
    so an entry whose gradient is near zero flips with rounding and moves a full step the other way,
    noise of the size of a fraction of the update, not of the weights.
    Statistics: ``|a - b| <= stats_rel * |b| + stats_abs``; clip fractions within :data:`CLIPFRAC_ABS`.
    """

    params: float
    grads: float
    stats_rel: float
    stats_abs: float
    per_tensor: bool = True


#: A clip fraction counts tokens on either side of a comparison. On the critic's first mini-batch the
#: predictions equal the old values, so verl's ``vf_clipfrac`` (clipped loss > unclipped loss) is decided
#: by rounding: one token of ~130 flips between fp32 variants (measured). Up to two tokens are allowed.
CLIPFRAC_ABS = 1e-2

# fp32: every knob is an exact no-op up to the order of float additions: measured worst 6.5e-6 (padded
# critic parameters), statistics 5e-5 relative; gradients 1.26e-5 (padded vs packed attention, the critic's
# v_proj.bias on its second step, with the head-size-32 tiny model: the biases' gradients are sums over
# every token), so gradients get 3x the parameters' tolerance. A bug is 1e-2 and more.
EXACT = Tolerance(params=TOL, grads=3 * TOL, stats_rel=1e-4, stats_abs=1e-6)
# bf16 (verl's default compute dtype: fp32 master weights and gradient reduce) keeps 8 significant bits,
# a relative rounding of 2^-8 = 3.9e-3 per operation; another micro-batch split rounds differently.
# Measured worst (the table test_invariance.py prints): gradients 6.0e-3 of their norm (bf16 knobs) and
# 7.1e-3 (bf16 vs fp32); parameters 2.9e-2 (knobs) and 6.4e-2 (vs fp32) of the update; statistics
# 4.7e-4 relative (grad_norm), and ppo_kl, a mean of log-prob differences near zero, 4.9e-5 absolute.
# The tolerances keep a 3x margin (x86 CPU, gloo) and stay far below what a bug does: a missing,
# doubled or reversed update is 1 to 2 of the update; a doubled loss doubles grad_norm (the gradients
# themselves are compared after clipping, which normalizes them); the entropy bonus at entropy_coeff=1
# moves the actor's gradient by 6.8e-2 and must fail the bf16 gradient tolerance
# (test_bf16_tolerance_sees_the_entropy_bonus).
BF16_NOISE = Tolerance(params=0.1, grads=2e-2, stats_rel=5e-3, stats_abs=2e-4, per_tensor=False)
BF16_VS_FP32 = Tolerance(params=0.2, grads=3e-2, stats_rel=5e-3, stats_abs=2e-4, per_tensor=False)


@dataclass(frozen=True)
class Check:
    """``variant`` must reproduce ``reference`` within ``tol``; ``parts`` = the models compared."""

    variant: str
    reference: str
    tol: Tolerance = EXACT
    parts: tuple[str, ...] = ("actor", "critic")


_ENTROPY_KNOBS = (
    "entropy_chunked",
    "entropy_checkpointing",
    "entropy_chunked_checkpointing_micro_1",
    "entropy_compiled",
)
_LAYERS_3 = tuple(v for v in VARIANTS_2 if VARIANTS_2[v].get("ppotune.tiny.num_hidden_layers") == 3)
_NOT_BASE = ("base", "critic_mini_4", "entropy", *_ENTROPY_KNOBS, *_LAYERS_3)

CHECKS_FP32 = [
    *(Check(v, "base") for v in VARIANTS_2 if v not in _NOT_BASE),
    Check("one_process", "base"),
    *(Check(v, "layers_3") for v in _LAYERS_3 if v != "layers_3"),
    Check("critic_mini_4", "one_process_critic_mini_4"),
    Check("critic_mini_4", "base", parts=("actor",)),  # the critic's mini-batch does not touch the actor
    Check("entropy", "base", parts=("critic",)),
    *(Check(v, "entropy") for v in _ENTROPY_KNOBS),
    # GRPO: the actor alone (no critic); one process groups the same responses as two ranks do
    *(Check(v, "grpo_base", parts=("actor",)) for v in VARIANTS_GRPO_2 if v not in ("grpo_base", "grpo_no_kl_loss")),
    Check("grpo_one_process", "grpo_base", parts=("actor",)),
]
CHECKS_BF16 = [
    *(Check(v, "bf16_base", BF16_NOISE) for v in VARIANTS_BF16_2 if v != "bf16_base"),
    Check("bf16_one_process", "bf16_base", BF16_NOISE),
    Check("bf16_base", "base", BF16_VS_FP32),
]
#: A change the bf16 tolerance must still see: the entropy bonus, a few percent of the actor's gradient.
SEEN_BY_BF16 = Check("entropy", "base", BF16_NOISE, parts=("actor",))
#: (variant, reference): an offload knob moves tensors and changes no arithmetic, so its run gives its reference's
#: gradients and parameters bit for bit (on a CPU the worker runs every offload knob's mechanism too).
BIT_FOR_BIT = [
    ("param_offload", "base"),
    ("optimizer_offload", "base"),
    ("param_and_optimizer_offload", "base"),
    ("activation_offload", "layers_3"),
    ("fsdp2_activation_offload", "fsdp2_layers_3"),
    ("activation_offload_checkpointing", "layers_3_checkpointing"),
    ("fsdp2_activation_offload_checkpointing", "fsdp2_layers_3_checkpointing"),
    ("fsdp2_offload_policy", "fsdp2"),
    ("grpo_param_and_optimizer_offload", "grpo_base"),
]
#: (variant, reference, part) that must differ by far more than the exact tolerance: the knob acts.
MUST_DIFFER = [
    ("critic_mini_4", "base", "critic"),
    ("entropy", "base", "actor"),
    ("grpo_no_kl_loss", "grpo_base", "actor"),
    ("grpo_base", "base", "actor"),
]


def bit_differences(got: dict, variant: str, reference: str) -> list[str]:
    """The tensors (parameters, and gradients at each optimizer step) of ``variant`` not bitwise equal to
    ``reference``'s."""
    a, b = got[variant], got[reference]
    out = []
    for part in ("actor", "critic"):
        if part not in b:
            continue
        out += [f"{part}.{k}" for k in b[part] if not torch.equal(a[part][k], b[part][k])]
        for step, (ga, gb) in enumerate(zip(a["grads"][part], b["grads"][part], strict=True)):
            out += [f"{part}.grad.{k} (step {step})" for k in gb if not torch.equal(ga[k], gb[k])]
    return out


def run_variants(nproc: int, out: Path, variants: dict, env: dict | None = None) -> dict:
    """torchrun the worker over ``variants``; -> {variant: saved parameters, gradients and stats}.

    Every variant of one call runs in the same torchrun (one start-up of torch and the process group).
    """
    spec = out / f"variants{nproc}.json"
    spec.write_text(json.dumps(variants))
    t0 = time.perf_counter()
    torchrun(WORKER, out, spec, nproc=nproc, env=env)
    elapsed = time.perf_counter() - t0
    print(f"invariance: {len(variants)} variants on {nproc} process(es) in {elapsed:.1f} s")
    return {name: torch.load(out / f"{name}.pt") for name in variants}


#: How many launches in a row may save nothing before the rest of the variants are given up: a launch that fails
#: before its first variant is saved is a start-up failure as likely as a first variant's, and each retry costs a
#: start of torch and the process group.
BARREN_LAUNCHES = 3
# the line of a traceback that names the exception (not torchrun's own summary of a failed rank)
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*$", re.MULTILINE)


def _why(log: Path, returncode: int | str) -> str:
    """One line on a failed launch: its last exception line (or last line) and where the whole log is."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [m.group(0) for m in _EXCEPTION_LINE.finditer(text) if "ChildFailedError" not in m.group(0)]
    last = (lines or [ln for ln in text.splitlines() if ln.strip()] or ["(no output)"])[-1]
    return f"launch exit {returncode}: {last.strip()[:300]} (log: {log})"


def torchrun_logged(nproc: int, env: dict | None = None, timeout: int = 900) -> Callable[[Path, Path], int | str]:
    """A launch for :func:`run_variants_caught`: torchrun of the worker (as :func:`torchrun.torchrun` starts it),
    its output streamed to ``log`` as it runs, so a launch cut short by a timeout or a signal leaves it."""

    def launch(spec: Path, log: Path) -> int | str:
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        with log.open("w") as f:
            try:
                return subprocess.run(
                    [*cmd, str(WORKER), str(spec.parent), str(spec)],
                    cwd=ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                    env={**os.environ, "PYTHONPATH": path, **(env or {})},
                ).returncode
            except subprocess.TimeoutExpired:
                return f"timeout after {timeout} s"

    return launch


def run_variants_caught(
    nproc: int,
    out: Path,
    variants: dict,
    env: dict | None = None,
    *,
    launch: Callable[[Path, Path], int | str] | None = None,
) -> tuple[dict, dict[str, str]]:
    """:func:`run_variants`, each variant caught alone; -> ({variant: saved}, {variant: why it has no result}).

    The worker saves each variant as it finishes, in order, so when a launch fails the first variant it did not
    save is the one that failed: it is recorded with the launch's last exception line, and the variants after it
    run in a new launch. One variant's failure costs one more start-up instead of hiding every result after it.
    ``launch(spec, log)`` runs the worker over ``spec`` (its output to ``log``) and returns its exit status (or why
    it has none); by default :func:`torchrun_logged`.
    """
    launch = launch or torchrun_logged(nproc, env)
    got: dict = {}
    missing: dict[str, str] = {}
    pending = list(variants)
    barren = 0
    for attempt in range(1, len(variants) + 1):
        if not pending:
            break
        spec, log = out / f"variants{nproc}-{attempt}.json", out / f"variants{nproc}-{attempt}.log"
        spec.write_text(json.dumps({name: variants[name] for name in pending}))
        for name in pending:  # a result left by an earlier run in this folder is not this launch's
            (out / f"{name}.pt").unlink(missing_ok=True)
        t0 = time.perf_counter()
        status = launch(spec, log)
        saved = []
        for name in pending:
            if not (out / f"{name}.pt").is_file():
                break
            try:
                got[name] = torch.load(out / f"{name}.pt")
            except Exception as exc:  # noqa: BLE001 - one unreadable result is that variant's failure alone
                missing[name] = f"its result does not load: {type(exc).__name__}: {exc}"
            saved.append(name)
        print(
            f"invariance: launch {attempt}, {len(saved)} of {len(pending)} variants on {nproc} process(es) in "
            f"{time.perf_counter() - t0:.1f} s, exit {status}",
            flush=True,
        )
        pending = pending[len(saved) :]
        if status == 0 and not pending:
            break
        barren = 0 if saved else barren + 1
        if not pending:  # every variant saved, then the launch failed (its barrier or its teardown)
            print(f"invariance: every variant saved, then {_why(log, status)}", flush=True)
            break
        failed, pending = pending[0], pending[1:]
        missing[failed] = _why(log, status)
        print(f"invariance: {failed} FAILED: {missing[failed]}", flush=True)
        if barren >= BARREN_LAUNCHES:
            for name in pending:
                missing[name] = f"not run: {barren} launches in a row saved nothing ({missing[failed]})"
            pending = []
    return got, missing


def caught_failures(got: dict, missing: dict[str, str], check: Check) -> list[str]:
    """:func:`failures`, but a check whose variant or reference has no result says why, and a comparison that
    raises is that check's failure alone."""
    absent = [v for v in dict.fromkeys((check.variant, check.reference)) if v not in got]
    if absent:
        return [
            f"{check.variant} vs {check.reference}: not compared, {v} has no result ({missing.get(v, 'not run')})"
            for v in absent
        ]
    try:
        return failures(got, check)
    except Exception as exc:  # noqa: BLE001 - the other checks still report
        return [f"{check.variant} vs {check.reference}: the comparison raised {type(exc).__name__}: {exc}"]


# Softmax is shift-invariant, so the exact gradient of a key-projection bias is zero: what the
# backward gives is rounding noise, which Adam normalizes into a full-size step of random sign.
# Those tensors carry no signal about the knobs and are left out (their gradients too).
_ZERO_GRADIENT = ("self_attn.k_proj.bias",)


#: A tensor holding less than this share of the model's norm is judged with the whole model, not alone: a
#: gradient that is a sum with heavy cancellation (the critic's scalar score.bias on its second optimizer
#: step: 1.3e-3 of the gradient's norm, after 5.7e-2 on the first) keeps the summands' rounding (2.2e-7
#: measured between padded and packed attention: 1.7e-4 of the small sum, 4.9e-6 of the whole gradient),
#: noise of the summands' size, not of the sum's. Every parameter tensor holds more than this share.
_SMALL_SHARE = 0.01


def max_rel_diff(a: dict, b: dict) -> tuple[float, str]:
    """The largest per-tensor relative difference ``||a - b|| / ||b||`` over the tensors of ``b`` and its name;
    tensors below :data:`_SMALL_SHARE` of the model's norm count through the whole model's difference."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    keys = [k for k in b if not k.endswith(_ZERO_GRADIENT)]
    whole = torch.sqrt(sum(b[k].float().pow(2).sum() for k in keys))
    worst, where = model_rel_diff(a, b), "(the whole model)"
    for k in keys:
        norm = b[k].float().norm()
        if norm < _SMALL_SHARE * whole:
            continue
        rel = ((a[k].float() - b[k].float()).norm() / norm.clamp(min=1e-12)).item()
        if rel > worst:
            worst, where = rel, k
    return worst, where


def model_rel_diff(a: dict, b: dict, origin: dict | None = None) -> float:
    """``||a - b|| / ||b - origin||`` with every tensor of the model in one vector (``origin`` 0 if None)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    keys = [k for k in b if not k.endswith(_ZERO_GRADIENT)]
    num = sum((a[k].float() - b[k].float()).pow(2).sum() for k in keys)
    den = sum((b[k].float() - (0 if origin is None else origin[k].float())).pow(2).sum() for k in keys)
    return (num.sqrt() / den.sqrt().clamp(min=1e-12)).item()


def differences(got: dict, check: Check) -> dict:
    """{"<part>" | "<part>.grad": (relative difference, where), "stats": (worst fraction of its tolerance,
    which)} of ``check.variant`` against ``check.reference``; gradients: the worst optimizer step."""
    a, b, tol = got[check.variant], got[check.reference], check.tol
    out = {}
    for part in check.parts:
        ga, gb = a["grads"][part], b["grads"][part]
        assert len(ga) == len(gb), f"{check.variant}: {len(ga)} {part} optimizer steps, {check.reference}: {len(gb)}"
        if tol.per_tensor:
            out[part] = max_rel_diff(a[part], b[part])
            rel, key, step = max((*max_rel_diff(x, y), i) for i, (x, y) in enumerate(zip(ga, gb)))
            out[f"{part}.grad"] = (rel, f"{key} (step {step})")
        else:
            out[part] = (model_rel_diff(a[part], b[part], origin=b[f"init_{part}"]), "(of the update)")
            rel, step = max((model_rel_diff(x, y), i) for i, (x, y) in enumerate(zip(ga, gb)))
            out[f"{part}.grad"] = (rel, f"(step {step})")
    worst, where = 0.0, ""
    for k, v in b["stats"].items():
        if k.split("/")[0] not in check.parts:
            continue
        allowed = CLIPFRAC_ABS if "clipfrac" in k else tol.stats_rel * abs(v) + tol.stats_abs
        frac = abs(a["stats"][k] - v) / allowed
        if frac > worst:
            worst, where = frac, f"{k} {a['stats'][k]:.6g} vs {v:.6g}"
    out["stats"] = (worst, where)
    return out


def failures(got: dict, check: Check) -> list[str]:
    """What ``check`` finds out of tolerance (empty when the variant reproduces its reference)."""
    tol = {"stats": 1.0}
    for part in check.parts:
        tol[part], tol[f"{part}.grad"] = check.tol.params, check.tol.grads
    return [
        f"{check.variant} vs {check.reference}: {what} {where} "
        + (
            f"differs by {rel:.1f}x its tolerance"
            if what == "stats"
            else f"differs by {rel:.2e} (tolerance {tol[what]:.0e})"
        )
        for what, (rel, where) in differences(got, check).items()
        if rel > tol[what]
    ]


def table(got: dict, checks: list[Check]) -> str:
    """The measured worst differences of every check, one row each (stats: the fraction of its tolerance)."""
    cols = ["actor", "actor.grad", "critic", "critic.grad", "stats"]
    head = f"{'variant':<38} {'reference':<26} {'scope':<7}" + "".join(f"{c:>12}" for c in cols[:-1]) + "  stats/tol"
    lines = [head]
    for check in checks:
        d = differences(got, check)
        cells = "".join(f"{d[c][0]:12.1e}" if c in d else f"{'-':>12}" for c in cols[:-1])
        scope = "tensor" if check.tol.per_tensor else "model"
        lines.append(f"{check.variant:<38} {check.reference:<26} {scope:<7}{cells}  {d['stats'][0]:9.2f}")
    return "\n".join(lines)
