"""A calibrated, torch-free memory model of a PPO trial: per-phase peak memory per GPU from its config.

Analytic terms from the config and the model's HF shape (:mod:`.terms`: model states sharded by FSDP,
unsharded FSDP units, activations and logits of the largest micro-batch, the KV cache of generation),
weighed per study by a regularized least-squares fit to the per-phase peaks its trials recorded
(:mod:`.fit`), with an error measured by leave-one-out. Typical use::

    samples = samples_from_trials(study.get_trials(deepcopy=False), study.user_attrs["base_config"])
    model = MemoryModel.calibrate(samples)
    pred = model.predict(candidate_flat_config)                 # typical lengths, the trial's world size
    model.over_limit(pred.peak_gb, limit_gb)                    # over by more than the model's error
    model.predict(config, world=64).state_gb                    # the states projected to 64 GPUs
    model.predict(config, worst_case=True).peak_gb              # every sequence at its maximum length
    study.set_user_attr("memory_model", model.to_dict())        # MemoryModel.from_dict(...) reads it back
"""

from tuner.memory_model.fit import (
    ERROR_COVERAGE,
    FEATURES,
    MIN_ERROR,
    MIN_LOO_SAMPLES,
    MemoryModel,
    MemoryPrediction,
    features_gb,
    fit_phase,
    prediction_factor,
)
from tuner.memory_model.samples import Sample, sample_from_attrs, samples_from_trials
from tuner.memory_model.shape import ModelShape, ParamCounts, param_counts, shape_of_config
from tuner.memory_model.terms import TERMS, flat_config, phase_terms
from tuner.memory_model.workload import Lengths, MicroBatch, Plan, largest_micro_batch

__all__ = [
    "FEATURES",
    "ERROR_COVERAGE",
    "MIN_ERROR",
    "MIN_LOO_SAMPLES",
    "TERMS",
    "Lengths",
    "MemoryModel",
    "MicroBatch",
    "ModelShape",
    "ParamCounts",
    "Plan",
    "MemoryPrediction",
    "Sample",
    "features_gb",
    "fit_phase",
    "flat_config",
    "largest_micro_batch",
    "param_counts",
    "phase_terms",
    "prediction_factor",
    "sample_from_attrs",
    "samples_from_trials",
    "shape_of_config",
]
