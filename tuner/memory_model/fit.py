"""The calibrated model: per phase, peak = Σ_k w_k · term_k + ρ · carry + c, fitted per study.

Features (GB) of a phase are its analytic terms (:mod:`tuner.memory_model.terms`) and ``carry``: the
largest transient (buffers, activations, attention, logits, KV cache, engine) of any phase of the step.
On CPU the recorded per-phase peaks are high-water marks of memory that the allocator keeps: glibc's heap
keeps much of what a phase freed resident, so a phase's recorded peak includes what an earlier phase or
step left behind (phases that allocate nothing record most of the step's largest peak: benchmarks/README.md,
"The memory model"). On a GPU a phase records the allocator's *allocated* peak within it (the
reserved peak reads the same in every phase: the caching allocator keeps every segment; docs/gpu.md),
and the objective offset (NVML and the reserved peak over the largest phase) carries the cache and the
CUDA context. ``carry`` stands for what is left behind, with a prior weight of 0 (the analytic model has
no such memory) that the data moves. What the allocator keeps varies from run to run, so the per-phase
peaks are predicted less well than the largest one (the memory objective), and their error is stated
apart.

The fit (one per phase, each with its own constant ``c``) minimises

    Σ_i ((y_i - ŷ_i) / (σ · y_i))²  +  Σ_k ((w_k - w0_k) / τ)²  +  (c / (10 · ȳ))²,   w_k >= 0

a maximum a posteriori estimate with Gaussian noise on the *relative* error (the error the gate and the
report state is relative, and peaks span a factor of several within a study) and a Gaussian prior on
each weight centred on the analytic value (``w0 = 1`` for the terms, 0 for ``carry``), ``c`` nearly free.
Why this and not plain least squares:

* a handful of trials cannot pin 6-8 coefficients: with one trial the weights stay at the prior and ``c``
  takes the residual (the analytic model, shifted); with two, the one direction they differ in moves;
  the fit never explodes, whatever the number of trials;
* features that do not vary within a study (the states when the world size and offload are fixed, the
  vocabulary in the logits) are collinear with ``c``: plain least squares is singular there, the prior
  keeps their weight at 1, so that projecting to another world size scales the states analytically;
* weights stay non-negative (a term cannot free memory), solved exactly by enumerating which weights sit
  at 0 (a handful of features per phase);
* σ = 3 %: a measured peak's repeat-to-repeat noise (see docs/decisions.md#memory-model-noise); τ = 0.5: the
  analytic terms are trusted to within a factor of about 1.5-2 (allocator rounding,
  framework tensors not counted, the recorded lengths' own spread).

The model's error is measured by leave-one-out over the calibration trials: each trial predicted by a
model fitted without it (with the typical lengths of the others, as an unlaunched candidate is), relative
error ``|pred - meas| / meas`` of the peak (median, max, RMS), of each phase and of all phases pooled.
A candidate is "over a limit" only when its prediction exceeds the limit by more than the gate's error:
the largest of the leave-one-out maximum, k(n) x the RMS and 5 % (:meth:`MemoryModel.over_limit`), and only
from 5 calibration trials on. k(n) is the two-sided 99 % prediction factor of one new trial from n
leave-one-out errors (Student's t with n - 1 degrees of freedom, x sqrt(1 + 1/n)): 5.0 at 5 trials, 4.3 at
6, 3.4 at 10, 3.0 at 16, 2.6 in the limit: a fixed multiple of the RMS, or the leave-one-out maximum alone,
let more held-out trials fall beyond the stated error (see docs/decisions.md#memory-gate-error).
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from trainer.contracts import PHASES
from tuner.memory_model.samples import Sample
from tuner.memory_model.shape import ModelShape, shape_of_config
from tuner.memory_model.terms import TERMS, TRANSIENT_TERMS, PhaseTerms, flat_config, phase_terms, world_of
from tuner.memory_model.workload import Lengths

__all__ = [
    "FEATURES",
    "PRIOR_WEIGHTS",
    "NOISE_REL",
    "PRIOR_SD",
    "MIN_ERROR",
    "ERROR_COVERAGE",
    "MIN_LOO_SAMPLES",
    "features_gb",
    "fit_phase",
    "MemoryPrediction",
    "MemoryModel",
]

GB = 1024**3  # the trainer's GB (trainer.engine.metrics.GB): GiB
#: The regression's features per phase: the analytic terms and the memory carried from other phases.
FEATURES = (*TERMS, "carry")
#: The analytic prior of each weight.
PRIOR_WEIGHTS = {**dict.fromkeys(TERMS, 1.0), "carry": 0.0}
#: σ: the relative noise of one measured peak.
NOISE_REL = 0.03
#: τ: the prior's standard deviation of a weight.
PRIOR_SD = 0.5
#: the constant's prior standard deviation, relative to the phase's mean peak (nearly free)
_CONSTANT_SD_REL = 10.0
#: The smallest error the gate assumes (a leave-one-out over a few trials can be lucky).
MIN_ERROR = 0.05
#: The two-sided coverage of a stated error: the gate's error is at least :func:`prediction_factor` x the
#: leave-one-out RMS error, which the maximum of a handful of leave-one-out errors under-states.
ERROR_COVERAGE = 0.99
#: Below this many calibration trials the model states no error and gates nothing.
MIN_LOO_SAMPLES = 5
_SCHEMA = 1


def features_gb(terms: PhaseTerms) -> dict[str, dict[str, float]]:
    """``{phase: {feature: GB}}`` from :func:`tuner.memory_model.terms.phase_terms`' bytes."""
    transient = {p: sum(terms[p][t] for t in TRANSIENT_TERMS) for p in PHASES}
    out = {}
    for p in PHASES:
        carry = max(transient.values())
        out[p] = {**{t: terms[p][t] / GB for t in TERMS}, "carry": carry / GB}
    return out


def _bounded_lstsq(A: np.ndarray, b: np.ndarray, nonneg: Sequence[int]) -> np.ndarray:
    """min ||A x - b||² with x[j] >= 0 for j in ``nonneg``: the best feasible stationary point over every
    set of clamped coordinates (exact for this convex problem; ``nonneg`` is a handful of indices)."""
    x = np.linalg.lstsq(A, b, rcond=None)[0]
    if all(x[j] >= 0 for j in nonneg):
        return x
    best, best_cost = None, np.inf
    for r in range(1, len(nonneg) + 1):
        for clamped in itertools.combinations(nonneg, r):
            free = [j for j in range(A.shape[1]) if j not in clamped]
            xf = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
            cand = np.zeros(A.shape[1])
            cand[free] = xf
            if any(cand[j] < 0 for j in nonneg):
                continue
            cost = float(np.sum((A @ cand - b) ** 2))
            if cost < best_cost:
                best, best_cost = cand, cost
    assert best is not None  # clamping every weight leaves the constant alone: always feasible
    return best


def fit_phase(
    xs: Sequence[Mapping[str, float]],
    ys: Sequence[float],
    *,
    noise_rel: float = NOISE_REL,
    prior_sd: float = PRIOR_SD,
) -> tuple[dict[str, float], float]:
    """One phase's weights ``{feature: w}`` and constant (GB) from features ``xs`` (GB) and peaks ``ys`` (GB);
    see the module docstring. No samples: the prior (w0, c = 0)."""
    prior = np.array([PRIOR_WEIGHTS[f] for f in FEATURES])
    if not ys:
        return dict(zip(FEATURES, prior.tolist())), 0.0
    y = np.asarray(ys, dtype=float)
    X = np.array([[x[f] for f in FEATURES] for x in xs], dtype=float)
    # a feature that is 0 in every sample leaves the data untouched: its weight is the prior's
    used = [k for k in range(len(FEATURES)) if np.any(X[:, k] != 0)]
    scale = noise_rel * np.maximum(y, 0.05 * max(float(y.max()), 1e-9))
    data_A = np.hstack([X[:, used], np.ones((len(y), 1))]) / scale[:, None]
    k = len(used)
    prior_A = np.hstack([np.eye(k), np.zeros((k, 1))]) / prior_sd
    const_A = np.zeros((1, k + 1))
    const_A[0, k] = 1.0 / (_CONSTANT_SD_REL * max(float(y.mean()), 1e-9))
    A = np.vstack([data_A, prior_A, const_A])
    b = np.concatenate([y / scale, prior[used] / prior_sd, [0.0]])
    theta = _bounded_lstsq(A, b, nonneg=list(range(k)))
    w = prior.copy()
    w[used] = np.maximum(theta[:k], 0.0)
    return dict(zip(FEATURES, w.tolist())), float(theta[k])


@dataclass
class MemoryPrediction:
    """A config's predicted memory per GPU (GB)."""

    by_phase_gb: dict  # {phase: GB}
    peak_gb: float  # the memory objective: the largest phase (+ the study's objective offset)
    state_gb: dict  # {phase: GB}: the model-states part of each phase (sharded over ``world``)
    terms_gb: dict  # {phase: {feature | "constant": GB}}: each weighted contribution
    world: int  # the world size the states are sharded over
    worst_case: bool

    @property
    def peak_phase(self) -> str:
        return max(self.by_phase_gb, key=self.by_phase_gb.get)


def _typical_lengths(samples: Sequence[Sample]) -> Optional[Lengths]:
    """The median of each recorded percentile: the lengths a new candidate of the study will see (they are
    the data's and the initial policy's, not the knobs')."""
    if not samples:
        return None
    med = lambda part, k: statistics.median(getattr(s.lengths, part)[k] for s in samples)  # noqa: E731
    keys = ("p10", "p50", "p90", "max")
    return Lengths({k: med("prompt", k) for k in keys}, {k: med("response", k) for k in keys})


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas > 0 else float("inf")


def prediction_factor(n: int, coverage: float = ERROR_COVERAGE) -> float:
    """How many RMS errors bound one new trial's error with probability ``coverage`` when the RMS comes from
    ``n`` leave-one-out errors: Student's t quantile with n - 1 degrees of freedom (Cornish-Fisher expansion
    around the normal quantile, within 1.5 % from 4 degrees of freedom on) x sqrt(1 + 1/n)."""
    z = statistics.NormalDist().inv_cdf(0.5 + coverage / 2)
    nu = max(n - 1, 1)
    t = (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
    )
    return t * (1.0 + 1.0 / max(n, 1)) ** 0.5


def _bound(stats: dict, trials: int) -> float:
    """The stated error from leave-one-out ``stats`` over ``trials`` calibration trials: the larger of the
    worst error seen and :func:`prediction_factor` x the RMS."""
    return max(float(stats["max"]), prediction_factor(trials) * float(stats.get("rms", 0.0)))


def _stats(errors: Sequence[float]) -> dict:
    rms = (sum(e * e for e in errors) / len(errors)) ** 0.5
    return {"median": statistics.median(errors), "max": max(errors), "rms": rms, "n": len(errors)}


@dataclass
class MemoryModel:
    """Per-phase peak memory per GPU of a PPO trial, calibrated on a study's measured trials.

    Build it with :meth:`calibrate` (or :meth:`analytic` for the uncalibrated prior); :meth:`predict` a
    config (typical or worst-case lengths, the trial's world size or another); :meth:`over_limit` and
    :meth:`limit_margin` say whether a prediction is over a memory limit by more than the model's error.
    """

    shape: ModelShape
    on_gpu: bool
    weights: dict = field(default_factory=dict)  # {phase: {feature: w}}
    constants_gb: dict = field(default_factory=dict)  # {phase: c}
    objective_offset_gb: float = 0.0  # the objective over the largest phase (GPU: NVML sees the CUDA context)
    lengths: Optional[Lengths] = None  # the study's typical lengths
    # leave-one-out relative errors: {"peak": {median, max, rms, n}, "phases": (pooled), "by_phase": {phase: ...}}
    error: Optional[dict] = None
    loo: list = field(default_factory=list)  # [{"number", "measured_gb", "predicted_gb"}] per calibration trial
    num_samples: int = 0
    device_memory_gb: Optional[float] = None  # a GPU's memory (for a vLLM engine's utilization)
    noise_rel: float = NOISE_REL
    prior_sd: float = PRIOR_SD

    # ------------------------------------------------------------------ building
    @classmethod
    def analytic(
        cls, shape: ModelShape, *, on_gpu: bool, lengths: Optional[Lengths] = None, device_memory_gb=None
    ) -> "MemoryModel":
        """The uncalibrated model: every weight at its prior, no constant, no stated error."""
        return cls._fit([], shape=shape, on_gpu=on_gpu, lengths=lengths, device_memory_gb=device_memory_gb)

    @classmethod
    def calibrate(
        cls,
        samples: Sequence[Sample],
        *,
        device_memory_gb: Optional[float] = None,
        noise_rel: float = NOISE_REL,
        prior_sd: float = PRIOR_SD,
        leave_one_out: bool = True,
    ) -> "MemoryModel":
        """Fit on ``samples`` (:func:`tuner.memory_model.samples_from_trials`), then measure the error by
        leave-one-out (from :data:`MIN_LOO_SAMPLES` samples on)."""
        if not samples:
            raise ValueError("memory model: no calibration samples (ok trials with per-phase peaks)")
        kw = dict(shape=samples[0].shape, on_gpu=samples[0].on_gpu, device_memory_gb=device_memory_gb)
        kw.update(noise_rel=noise_rel, prior_sd=prior_sd)
        feats = [
            features_gb(phase_terms(s.config, s.shape, s.lengths, on_gpu=s.on_gpu, device_memory_gb=device_memory_gb))
            for s in samples
        ]
        model = cls._fit(samples, feats=feats, **kw)
        if leave_one_out and len(samples) >= MIN_LOO_SAMPLES:
            peak_errors, phase_errors, loo = [], {p: [] for p in PHASES}, []
            for i, held in enumerate(samples):
                rest = cls._fit(samples[:i] + samples[i + 1 :], feats=feats[:i] + feats[i + 1 :], **kw)
                pred = rest.predict(held.config, shape=held.shape)
                peak_errors.append(_rel(pred.peak_gb, held.peak_gb))
                for p, meas in held.by_phase_gb.items():
                    if meas > 0:
                        phase_errors[p].append(_rel(pred.by_phase_gb[p], meas))
                loo.append({"number": held.number, "measured_gb": held.peak_gb, "predicted_gb": pred.peak_gb})
            model.error = {
                "peak": _stats(peak_errors),
                "phases": _stats([e for errors in phase_errors.values() for e in errors]),  # every phase pooled
                "by_phase": {p: _stats(e) for p, e in phase_errors.items() if e},
            }
            model.loo = loo
        return model

    @classmethod
    def _fit(cls, samples: Sequence[Sample], *, feats: Optional[list] = None, **kw) -> "MemoryModel":
        """Fit on ``samples`` (``feats``: their :func:`features_gb`, when already computed)."""
        lengths = kw.pop("lengths", None) or _typical_lengths(samples)
        model = cls(lengths=lengths, num_samples=len(samples), **kw)
        if feats is None:
            feats = [features_gb(model._terms(s.config, s.shape, s.lengths, world=None)) for s in samples]
        for p in PHASES:
            rows = [(f[p], s.by_phase_gb[p]) for f, s in zip(feats, samples) if s.by_phase_gb.get(p, 0) > 0]
            xs, ys = [x for x, _ in rows], [y for _, y in rows]
            fitted = fit_phase(xs, ys, noise_rel=model.noise_rel, prior_sd=model.prior_sd)
            model.weights[p], model.constants_gb[p] = fitted
        gaps = [s.peak_gb - max(s.by_phase_gb.values()) for s in samples if s.by_phase_gb]
        model.objective_offset_gb = max(0.0, statistics.median(gaps)) if gaps else 0.0
        return model

    # ------------------------------------------------------------------ predicting
    def _terms(self, config, shape: ModelShape, lengths: Lengths, *, world: Optional[int]) -> PhaseTerms:
        return phase_terms(
            config, shape, lengths, on_gpu=self.on_gpu, world=world, device_memory_gb=self.device_memory_gb
        )

    def predict(
        self,
        config: Mapping[str, Any],
        *,
        world: Optional[int] = None,
        lengths: Optional[Lengths] = None,
        worst_case: bool = False,
        shape: Optional[ModelShape] = None,
    ) -> MemoryPrediction:
        """The per-phase and objective peaks (GB per GPU) of ``config`` (nested or flat).

        ``world``: shard the states over this many GPUs instead of the config's world size, at the config's
        per-GPU batch (a trial on a few GPUs projected to the production job). ``worst_case``: every prompt
        at ``data.max_prompt_length``, every response at ``data.max_response_length``, token budgets filled
        (and never below the typical batch, term by term); else ``lengths``, by default the study's typical
        lengths (the worst case when the model has none).
        ``shape``: the actor's shape (default: the study's, with a tiny preset's width from the config).
        """
        flat = flat_config(config)
        shape = shape or shape_of_config(flat, self.shape)
        worst = Lengths.worst_case(int(flat["data.max_prompt_length"]), int(flat["data.max_response_length"]))
        typical = lengths or self.lengths
        terms = self._terms(flat, shape, worst if worst_case or typical is None else typical, world=world)
        if worst_case and typical is not None:
            # padded rows under a token budget are most numerous when sequences are SHORT: term by term, the
            # worst case is the larger of the all-maximum batch and the typical one
            other = self._terms(flat, shape, typical, world=world)
            terms = {p: {t: max(v, other[p][t]) for t, v in ts.items()} for p, ts in terms.items()}
        feats = features_gb(terms)
        by_phase, states, contributions = {}, {}, {}
        for p in PHASES:
            w = self.weights.get(p) or PRIOR_WEIGHTS
            parts = {f: w.get(f, PRIOR_WEIGHTS[f]) * feats[p][f] for f in FEATURES}
            parts["constant"] = self.constants_gb.get(p, 0.0)
            contributions[p] = parts
            by_phase[p] = max(0.0, sum(parts.values()))
            states[p] = parts["states"]
        peak = max(by_phase.values()) + self.objective_offset_gb
        return MemoryPrediction(
            by_phase_gb=by_phase,
            peak_gb=peak,
            state_gb=states,
            terms_gb=contributions,
            world=int(world or world_of(flat)),
            worst_case=worst_case or typical is None,
        )

    # ------------------------------------------------------------------ the gate
    @property
    def gate_error(self) -> Optional[float]:
        """The relative error the gate allows: the largest of the peak's leave-one-out maximum error,
        :func:`prediction_factor` x its RMS and :data:`MIN_ERROR`; None (no gating) below
        :data:`MIN_LOO_SAMPLES` calibration trials."""
        if not self.error:
            return None
        peak = self.error["peak"]
        return max(MIN_ERROR, _bound(peak, int(peak["n"])))

    def phase_error(self, phase: Optional[str] = None) -> Optional[float]:
        """The stated relative error of a per-phase peak: the gate's rule (:attr:`gate_error`) applied to all
        phases' leave-one-out errors pooled (n x 9 of them) and, given a ``phase``, to that phase's own, the
        larger (a phase's own spread over a handful of trials can be lucky). The pooled errors count as many
        trials as the peak's (the phases of one trial err together). None without a stated error."""
        error = self.error or {}
        if not error:
            return None
        trials = int(error["peak"]["n"])
        rules = [_bound(error["phases"], trials)]
        own = error.get("by_phase", {}).get(phase) if phase else None
        if own:
            rules.append(_bound(own, int(own["n"])))
        return max(MIN_ERROR, *rules)

    def limit_margin(self, pred_gb: float, limit_gb: float) -> Optional[float]:
        """How far over ``limit_gb`` a prediction is even if the model over-predicts by its whole error:
        ``pred / (1 + error) / limit - 1`` (> 0: over by more than the error; the size says by how much, as
        the study's graded constraint ``peak / limit - 1`` does). None without a stated error."""
        err = self.gate_error
        if err is None or limit_gb <= 0:
            return None
        return pred_gb / (1.0 + err) / limit_gb - 1.0

    def over_limit(self, pred_gb: float, limit_gb: float) -> bool:
        """Predicted over ``limit_gb`` by more than the model's error (never without a stated error)."""
        margin = self.limit_margin(pred_gb, limit_gb)
        return margin is not None and margin > 0

    def near_limit(self, pred_gb: float, limit_gb: float) -> bool:
        """Within the model's error of ``limit_gb`` on either side: the prediction cannot tell whether it fits
        (the candidates worth measuring to learn the boundary). False without a stated error."""
        err = self.gate_error
        if err is None or limit_gb <= 0:
            return False
        return pred_gb / (1.0 + err) <= limit_gb <= pred_gb * (1.0 + err)

    # ------------------------------------------------------------------ storing
    def to_dict(self) -> dict:
        """JSON-safe (plain floats, strings, lists): a study user attr."""
        return {
            "schema": _SCHEMA,
            "shape": self.shape.to_dict(),
            "on_gpu": self.on_gpu,
            "weights": {p: {f: float(v) for f, v in w.items()} for p, w in self.weights.items()},
            "constants_gb": {p: float(v) for p, v in self.constants_gb.items()},
            "objective_offset_gb": float(self.objective_offset_gb),
            "lengths": self.lengths.to_dict() if self.lengths else None,
            "error": self.error,
            "loo": [{k: (float(v) if isinstance(v, float) else v) for k, v in r.items()} for r in self.loo],
            "num_samples": self.num_samples,
            "device_memory_gb": self.device_memory_gb,
            "noise_rel": self.noise_rel,
            "prior_sd": self.prior_sd,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MemoryModel":
        if d.get("schema") != _SCHEMA:
            raise ValueError(f"memory model: schema {d.get('schema')!r}, this version reads {_SCHEMA}")
        return cls(
            shape=ModelShape.from_dict(d["shape"]),
            on_gpu=bool(d["on_gpu"]),
            weights={p: dict(w) for p, w in d["weights"].items()},
            constants_gb=dict(d["constants_gb"]),
            objective_offset_gb=float(d["objective_offset_gb"]),
            lengths=Lengths.from_dict(d["lengths"]) if d.get("lengths") else None,
            error=d.get("error"),
            loo=list(d.get("loo") or []),
            num_samples=int(d.get("num_samples") or 0),
            device_memory_gb=d.get("device_memory_gb"),
            noise_rel=float(d.get("noise_rel", NOISE_REL)),
            prior_sd=float(d.get("prior_sd", PRIOR_SD)),
        )
