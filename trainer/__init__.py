"""ppotune's trainer: one FSDP KL-regularized PPO run (a short trial or a full training run)."""
