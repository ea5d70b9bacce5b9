"""A config's worst case, measured: one PPO step of the longest batch it admits.

A trial sees the initial policy's response lengths and the data's typical prompt lengths; production runs
out of memory when a batch of long prompts meets responses at ``max_response_length`` (hours in, once the
policy has learned to write long answers). The probe runs the config for one step with
``ppotune.worst_case`` (trainer/config/schema.py): every prompt ``data.max_prompt_length`` real tokens, every
response ``data.max_response_length`` tokens (EOS ignored), so every micro-batch holds as many tokens as
the config's micro-batch sizes and token budgets let the trainer's own packing put in it. Its per-phase
peaks are the config's worst case, on the memory objective's basis (GPU: NVML vs the allocator, the
larger; CPU: resident memory above the post-start level), measured like a trial by the same runner
(:class:`tuner.trials.runners.SubprocessRunner`, or a warm one). The probe's step trains on that synthetic batch:
its throughput means nothing and it saves nothing.

Through verl (a search with ``--engine verl``, or CONFIG a verl run file): verl's own step of generated prompts at
``data.max_prompt_length`` real tokens with ``actor_rollout_ref.rollout.ignore_eos=True``
(:mod:`trainer.verl_engine.worst_case`); its peak is the tuner's sample of verl's processes (verl records no
per-phase peaks), its lengths verl's own min/max.

:func:`probe` is what the search runs on its finalists (the result's :meth:`ProbeResult.to_dict` fits in
a study attribute); ``ppotune probe`` (:mod:`tuner.commands.probe`) runs it alone.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict
from trainer.contracts import PHASES, Status
from tuner.trials.runners import TrialOutcome, TrialRequest, TrialRunner

__all__ = [
    "WORST_CASE_ATTR",
    "PROBE_KEYS",
    "ProbeResult",
    "probe_config",
    "probe_result",
    "lengths_forced",
    "probe",
]

#: The study user attribute holding the search's probes: ``{trial number (str): ProbeResult.to_dict()}``.
WORST_CASE_ATTR = "worst_case"

#: What makes a config its worst-case probe: one measured step (no warm-up, no early stop, never pruned)
#: of forced-length batches, saving nothing.
PROBE_KEYS: dict[str, Any] = {
    "trainer.total_training_steps": 1,
    "ppotune.warmup_steps": 0,
    "ppotune.worst_case": True,
    "ppotune.precision": None,  # one step: nothing to stop early (the search's --precision 0)
    "ppotune.front": [],
    "trainer.default_local_dir": None,
}


@dataclass
class ProbeResult:
    """A worst-case probe of one config. JSON-safe through :meth:`to_dict` / :meth:`from_dict`."""

    status: Status  # ok (it fits) | oom | crash | hang | invalid (refused: no probe ran) | interrupted
    # the largest peak of the step, on the memory objective's basis (memory_source); None when none was measured
    peak_memory_gb: Optional[float] = None
    peak_memory_by_phase_gb: dict = field(default_factory=dict)  # phase -> GB, same basis (PHASES order)
    memory_source: Optional[str] = None  # rss_above_start (CPU) | nvml | torch_cuda ... (as a trial's)
    oom_phase: Optional[str] = None  # the phase a rank ran out of memory in
    duration_s: float = 0.0  # wall seconds the probe cost (its processes' start-up included)
    prompt_length: Optional[int] = None  # tokens of every prompt (data.max_prompt_length)
    response_length: Optional[int] = None  # tokens of every response (data.max_response_length)
    lengths: dict = field(default_factory=dict)  # the percentiles the run recorded (proof of the forcing)
    device: Optional[str] = None  # cpu | cuda: what it was measured on
    device_name: Optional[str] = None
    world_size: Optional[int] = None
    memory_limit_gb: Optional[float] = None  # the per-process cap it ran under (ppotune.memory_limit_gb)
    notes: list = field(default_factory=list)
    error: Optional[str] = None
    result_path: Optional[str] = None  # the run's result JSON
    log_path: Optional[str] = None

    @property
    def fits(self) -> bool:
        """The worst-case step ran through every phase (under the cap, if one was set)."""
        return self.status is Status.OK

    def within(self, limit_gb: float) -> bool:
        """It fits and its worst-case peak is at most ``limit_gb`` (e.g. the export's headroom limit)."""
        return self.fits and self.peak_memory_gb is not None and self.peak_memory_gb <= limit_gb

    def to_dict(self) -> dict:
        out = asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeResult":
        """Inverse of :meth:`to_dict`; unknown keys (a newer writer) are ignored."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["status"] = Status.parse(data.get("status")) or Status.CRASH
        return cls(**kwargs)

    def lines(self) -> list[str]:
        """What ``ppotune probe`` prints: the per-phase worst-case peaks, the overall peak, what it ran on."""
        where = self.device or "?"
        if self.device_name and self.device_name != self.device:
            where += f" ({self.device_name})"
        where += f", world size {self.world_size if self.world_size is not None else '?'}"
        shape = f"prompts {self.prompt_length} + responses {self.response_length} tokens"
        cap = f", under a cap of {self.memory_limit_gb} GB per process" if self.memory_limit_gb else ""
        out = []
        if self.peak_memory_by_phase_gb:
            out.append(f"worst-case peak per phase (GB, {self.memory_source}):")
            for phase in [p for p in PHASES if p in self.peak_memory_by_phase_gb]:
                out.append(f"  {phase:15s} {self.peak_memory_by_phase_gb[phase]:8.3f}")
        if self.fits:
            peak = f"{self.peak_memory_gb:.3f} GB" if self.peak_memory_gb is not None else "not measured"
            out.append(f"worst-case peak: {peak} ({self.memory_source}) on {where}; {shape}{cap}: fits")
        elif self.status is Status.OOM:
            out.append(
                f"worst case: OUT OF MEMORY in phase {self.oom_phase or '?'} on {where}; {shape}{cap}: {self.error}"
            )
        else:
            out.append(f"worst case: {self.status.value} on {where}; {shape}{cap}: {self.error or 'no result'}")
        return out


def probe_config(config: dict) -> dict:
    """The complete nested config of ``config``'s probe (:data:`PROBE_KEYS` set), validated; ConfigError."""
    return config_to_dict(config_from_dict(apply_overrides(config, PROBE_KEYS)))


def lengths_forced(lengths: dict, *, prompt_length: int, response_length: int) -> Optional[bool]:
    """Whether the recorded length percentiles show every prompt and every response at its maximum
    (p10 == max == the configured length; verl's runs record p10 only where min == max); None when the run
    recorded none."""
    want = {"prompt": prompt_length, "response": response_length}
    if not all(lengths.get(part) for part in want):
        return None
    return all(lengths[part].get("p10") == lengths[part].get("max") == n for part, n in want.items())


def _environment(result_path: Optional[str]) -> dict:
    if not result_path:
        return {}
    try:
        return json.loads(Path(result_path).read_text()).get("environment") or {}
    except (OSError, ValueError):
        return {}


def probe_result(outcome: TrialOutcome, config: dict, *, device_kind: Optional[str] = None) -> ProbeResult:
    """A probe's :class:`ProbeResult` from the runner's outcome for the probe ``config`` (its nested config)."""
    rec = outcome.record
    data, ppo = config["data"], config["ppotune"]
    env = _environment(rec.result_path)
    by_phase = rec.memory.get("by_phase_gb") or {}
    result = ProbeResult(
        status=outcome.status,
        peak_memory_gb=rec.peak_memory_gb,
        peak_memory_by_phase_gb={p: by_phase[p] for p in PHASES if p in by_phase},
        memory_source=rec.memory_source,
        oom_phase=rec.oom_phase,
        duration_s=float(rec.duration_s or 0.0),
        prompt_length=data["max_prompt_length"],
        response_length=data["max_response_length"],
        lengths=rec.lengths or {},
        device=env.get("device") or device_kind,
        device_name=env.get("device_name"),
        world_size=env.get("world_size") or config["trainer"]["n_gpus_per_node"] * config["trainer"]["nnodes"],
        memory_limit_gb=ppo.get("memory_limit_gb"),
        notes=list(rec.notes),
        error=rec.error,
        result_path=rec.result_path,
        log_path=rec.log_path,
    )
    forced = lengths_forced(result.lengths, prompt_length=result.prompt_length, response_length=result.response_length)
    if forced is False:  # e.g. an engine that stopped a response early: the figure is not the worst case
        result.notes.append(
            f"worst case NOT reached: recorded lengths {result.lengths} (want every prompt {result.prompt_length}, "
            f"every response {result.response_length} tokens)"
        )
    return result


def probe(
    config: dict,
    *,
    runner: TrialRunner,
    trial_dir: Path,
    number: int = 0,
    stop: Optional[threading.Event] = None,
    overrides: Optional[dict] = None,
) -> ProbeResult:
    """Run ``config`` (a complete nested config, as the tuner launches it) as its worst-case probe with
    ``runner``; its files go to ``trial_dir``. Never raises for what the run does: a config the probe refuses
    is ``invalid`` (not launched, 0 s), an OOM is ``oom`` with its phase.

    ``overrides``: what the config sets on top of the study's base (a verl runner builds its run file from them;
    verl's worst case is generated prompts at ``data.max_prompt_length`` and ``rollout.ignore_eos``:
    :mod:`trainer.verl_engine.worst_case`)."""
    limit = (config.get("ppotune") or {}).get("memory_limit_gb")
    try:
        cfg = probe_config(config)
    except ConfigError as e:
        return ProbeResult(Status.INVALID, memory_limit_gb=limit, error=f"config: {e}")
    request = TrialRequest(
        number=number, config=cfg, identity=("worst_case",), trial_dir=Path(trial_dir), overrides=dict(overrides or {})
    )
    outcome = runner.run(request, stop or threading.Event())
    return probe_result(outcome, cfg, device_kind=getattr(runner, "device_kind", None))
