"""ppotune's tuner: the Optuna search over per-GPU knobs. Never imports torch."""
