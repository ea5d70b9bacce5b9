"""ppotune's measurements inside verl's own processes, loaded through verl's plugin hook
(``VERL_USE_EXTERNAL_MODULES=trainer.verl_engine.plugin``, set by the verl trial engine on a CPU and a GPU alike).

* :mod:`.worker` (the FSDP worker processes): each worker call of a pass (old log-probs, ref, values, the critic's
  and the actor's update) resets the allocator's peak first (CUDA: the allocated peak; CPU: the resident-memory
  high-water mark, ``/proc/self/clear_refs``), counts the micro-batches verl cuts, and appends one line per rank
  to the run's phase log (``PPOTUNE_VERL_PHASE_LOG``).
* :mod:`.driver` (the trainer's process): each worker-group call of a pass carries its step and pass (and, in an
  in-run sweep, the current setting's keys: :mod:`trainer.verl_engine.schedule`) in its batch; each step's metrics
  row gets the setting it ran, the pass's peak (max over ranks), its micro-batches and the token lengths' percentiles.

verl's files are never touched; another verl version than the one the passes are named after (0.9.1) measures
nothing more than verl's own metrics (a hook that finds nothing to wrap says so once in the log).
"""

from __future__ import annotations

import os

from trainer.verl_engine.schedule import LOG_ENV


def _install() -> None:
    from trainer.verl_engine.plugin import driver, worker

    worker.install()
    driver.install()


if os.environ.get(LOG_ENV):
    _install()
