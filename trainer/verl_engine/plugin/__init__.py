"""ppotune's measurements inside verl's own processes, loaded through verl's plugin hook
(``VERL_USE_EXTERNAL_MODULES=trainer.verl_engine.plugin``, set by the verl trial engine on a CPU and a GPU alike).

* :mod:`.worker` (the FSDP worker processes): each worker call of a pass (old log-probs, ref, values, the critic's
  and the actor's update) resets the allocator's peak first (CUDA: the allocated peak; CPU: the resident-memory
  high-water mark, ``/proc/self/clear_refs``), counts the micro-batches verl cuts, and appends one line per rank
  to the run's phase log (``PPOTUNE_VERL_PHASE_LOG``).
* :mod:`.driver` (the trainer's process): each worker-group call of a pass carries its step and pass (and, in an
  in-run sweep, the current setting's keys: :mod:`trainer.verl_engine.schedule`) in its batch; each step's metrics
  row gets the setting it ran, the pass's peak (max over ranks), its micro-batches and the token lengths' percentiles.

verl's files are never touched. Before anything is patched, :mod:`.entry_points` reads verl's source for every
function the hooks wrap, with the parameters they pass; a verl that lacks one (another version than those the
hooks are read from: ``entry_points.TESTED_VERSIONS``) is refused in one line that names its version and what it
lacks, and the process exits: the trial records that line as its error (the adapter's ``classify_failure`` keeps
the last line with ``error:``) instead of measuring less than it claims.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Callable

from trainer.verl_engine.schedule import LOG_ENV

#: verl modules to patch once they are imported: {module: patch(module)}. Not at ``import verl`` time: that would
#: import verl's workers before the CPU shim has registered its platform (the hook loads the modules in order).
_PENDING: dict[str, Callable] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module is executed (the first time anything imports it)."""

    def find_spec(self, name, path, target=None):
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                run, patch = spec.loader.exec_module, _PENDING.pop(name)

                def exec_module(module, run=run, patch=patch):
                    run(module)
                    patch(module)

                spec.loader.exec_module = exec_module
                return spec
        return None


def _when_imported(name: str, patch: Callable) -> None:
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        _PENDING[name] = patch


def _install() -> None:
    from trainer.verl_engine.plugin.entry_points import refusal

    # verl imports this module from its own __init__ (VERL_USE_EXTERNAL_MODULES): an exception there would print
    # a traceback; SystemExit prints the one line and ends the process before Ray or any worker starts
    why = refusal()
    if why:
        raise SystemExit(why)
    from trainer.verl_engine.plugin import driver, worker

    for name, patch in (*worker.PATCHES.items(), *driver.PATCHES.items()):
        _when_imported(name, patch)
    if _PENDING and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


if os.environ.get(LOG_ENV):
    _install()
