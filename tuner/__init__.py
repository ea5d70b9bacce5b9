"""ppotune's tuner: the Optuna search over per-GPU knobs. Never imports torch."""

#: the version when the package's metadata cannot say (a source tree not installed); keep it pyproject's
__version__ = "0.1.0"
