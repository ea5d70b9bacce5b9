"""One config picked from the feasible Pareto front, written out (``ppotune export``: :mod:`tuner.commands.export`).

Outputs (in the out dir):
- ``best_config.yaml``  the complete training config: the study's base config with the
  chosen trial's overrides applied; ``ppotune train best_config.yaml`` runs it as is.
- ``verl_overrides.txt`` one Hydra ``key=value`` per line, verl keys only.
- ``verl_command.sh``    ``python -m verl.trainer.main_ppo`` with those overrides.
- ``why.md``             the chosen trial, the runner-up, the margin to the OOM boundary.

The pick never changes the algorithm: only the trial's overrides (per-GPU knobs and
their derived keys) are applied; global settings stay as the base config has them. (A space that marked
algorithm knobs on purpose is the exception, and why.md and the console say so first.)

The study is data: what is read from it is checked (:mod:`tuner.study.schema`), every value written into a
comment line is escaped and every argument of ``verl_command.sh`` quoted, and no interpreter named by the study
is written where it would run: ``verl_command.sh`` and the run file use the interpreter given with
``--engine-python`` (else ``python`` on the PATH, and the note says which one the trials ran).

Which trial is :mod:`tuner.results.pick`'s decision and why.md is :mod:`tuner.results.why`'s; both are
re-exported here (``choose``, ``Choice``, ``NoFit``, ``nearest_oom``) as the export's public surface.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DEFAULT_HEADROOM, StorageError
from trainer.verl_engine.overrides import hydra_value, verl_overrides
from tuner.results.pick import PICKS, Choice, NoFit, choose, pct, trial_row
from tuner.results.view import StudyView
from tuner.results.why import nearest_oom, why_md
from tuner.rules.finalists import describe
from tuner.rules.units import gb
from tuner.rules.world import WorldPlan, production_overrides
from tuner.study.frame import Fit, headroom_filter
from tuner.study.schema import comment_safe

__all__ = [
    "PICKS",
    "Choice",
    "Fit",
    "NoFit",
    "headroom_filter",
    "choose",
    "chosen_overrides",
    "best_config",
    "nearest_oom",
    "write_export",
    "ExportResult",
    "production_of",
    "verl_engine_of",
]

# Keys a trial sets to make it a short trial, not to tune it: production keeps the
# user's values (the base config holds them).
RUN_KEYS = frozenset(
    {
        "trainer.total_training_steps",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "ppotune.warmup_steps",
        "ppotune.memory_limit_gb",
        "ppotune.fault",
        "ppotune.worst_case",
        "ppotune.wandb",
    }
)


# --------------------------------------------------------------------------- the config
def production_of(view: StudyView) -> dict[str, Any]:
    """The production job's world and global batch sizes (none for a study whose trials ran them)."""
    target = view.attrs.get("target")
    return production_overrides(WorldPlan.from_dict(target)) if target else {}


def chosen_overrides(view: StudyView, number: int) -> dict[str, Any]:
    """The dotted keys trial ``number`` set (knobs + derived), minus the trial-length keys."""
    over = view.record(number).overrides
    if not isinstance(over, dict):
        over = dict(view.trial(number).params)  # contracts.md §3 always records overrides; params are the knobs
    return {k: v for k, v in over.items() if k not in RUN_KEYS}


def best_config(view: StudyView, number: int) -> dict:
    """The study's base config with trial ``number``'s overrides, at the production world with its global
    batch sizes (the study's ``target``, :mod:`tuner.rules.world`; the trials ran them scaled), validated; a full
    nested dict."""
    base = view.attrs.get("base_config")
    if not isinstance(base, dict):
        raise StorageError(f"study {view.name!r} has no base_config user attribute (contracts.md §3)")
    merged = apply_overrides(base, {**chosen_overrides(view, number), **production_of(view)})
    try:
        cfg = config_from_dict(merged, source="best_config.yaml")
    except ConfigError as e:
        raise StorageError(f"the config of trial #{number} does not validate: {e}") from None
    return config_to_dict(cfg)


# --------------------------------------------------------------------------- files
def verl_engine_of(view: StudyView, python: Optional[str] = None):
    """How the study's verl trials ran (``--engine verl``), or None for ppotune's own trainer. ``python``: the
    interpreter the user named (``--engine-python``); the study's own is never taken (None: ``python``)."""
    a = view.attrs
    if a.get("engine") != "verl":
        return None
    from tuner.trials.runners import VerlEngine

    missing = [k for k in ("engine_overrides", "steps", "warmup") if a.get(k) is None]
    if missing:
        raise StorageError(f"study {view.name!r} ran --engine verl but has no usable {missing[0]} attribute")
    return VerlEngine(
        python=python or "python",
        base_overrides=tuple(a["engine_overrides"]),
        steps=a["steps"],
        warmup=a["warmup"],
        memory_limit_gb=a.get("memory_limit_gb"),
    )


def _interpreter_note(view: StudyView, python: Optional[str]) -> Optional[str]:
    """What to say when the trials ran verl with an interpreter the user did not name here."""
    ran = view.attrs.get("engine_python")
    if view.attrs.get("engine") != "verl" or python is not None:
        return None
    where = f" (the study says its trials ran {comment_safe(ran)})" if ran else ""
    return f"verl_command.sh runs `python` from the PATH{where}: pass --engine-python PY to name the interpreter"


def _verl_command(
    view: StudyView, choice: Choice, lines: list[str], python: str = "python", note: Optional[str] = None
) -> str:
    base = {**flatten(view.attrs.get("base_config") or {}), **production_of(view)}
    assumed = [
        f"{k}={hydra_value(base[k])}"
        for k in (
            "data.train_batch_size",
            "data.max_prompt_length",
            "data.max_response_length",
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            "actor_rollout_ref.rollout.n",
        )
        if k in base
    ]
    nproc = view.attrs.get("nproc")
    target = view.attrs.get("target")
    if target and target["world"] != target["trial_world"]:
        measured = (
            f" {target['trial_world']} GPUs at the per-GPU batch of a {target['nnodes']} x "
            f"{target['n_gpus_per_node']}-GPU job with"
        )
    else:
        measured = f" {nproc} GPUs per node and" if nproc else ""
    out = [
        "#!/usr/bin/env bash",
        f"# ppotune export: study {comment_safe(view.name)}, trial #{choice.chosen} "
        f"({choice.pick}, headroom {pct(choice.headroom)}).",
    ]
    if view.algorithm_warning:
        out.append(f"# {comment_safe(view.algorithm_warning)}.")
    out += [
        "# The knobs below are per-GPU; they were measured with" + comment_safe(measured) + ":",
        "#   " + comment_safe(" ".join(assumed)),
        "# Append your run's own settings (model path, data files, batch sizes) as arguments: "
        "./verl_command.sh data.train_files=...",
    ]
    if note:
        out.append(f"# {comment_safe(note)}")
    out += [
        "set -euo pipefail",
        f"exec {shlex.quote(python)} -m verl.trainer.main_ppo \\",
    ]
    out += [f"    {shlex.quote(line)} \\" for line in lines]
    out.append('    "$@"')
    return "\n".join(out) + "\n"


def _study_args(view: StudyView) -> str:
    """``--storage URL --study NAME`` for a command line that reads this study again (password masked), for a
    comment line: quoted, then escaped."""
    return comment_safe(f"--storage {shlex.quote(view.storage.display)} --study {shlex.quote(view.name)}")


@dataclasses.dataclass
class ExportResult:
    choice: Choice
    files: dict[str, Path]
    overrides: list[str]
    note: Optional[str] = None  # what the user should know about the interpreter verl_command.sh runs


def write_export(
    view: StudyView,
    out_dir: str | Path,
    *,
    pick: str = "max-throughput",
    headroom: float = DEFAULT_HEADROOM,
    validate_verl: bool = False,
    engine_python: Optional[str] = None,
) -> ExportResult:
    """Choose, validate, then write the four files. Raises :class:`NoFit`/:class:`StorageError`
    (and verl_validate's errors with ``validate_verl``) before writing anything. ``engine_python``: the
    interpreter of the user's verl environment (``--engine-python``), the only one written where it runs."""
    if isinstance(view.attrs.get("fit"), dict):  # its probes are worst cases, not trials to pick from
        raise StorageError(f"study {view.name!r} is a ppotune fit's: its config is the fit.yaml ppotune fit wrote")
    choice = choose(view, pick=pick, headroom=headroom)
    overrides = chosen_overrides(view, choice.chosen)
    verl = verl_engine_of(view, engine_python)
    note = _interpreter_note(view, engine_python)
    if verl is None:
        config = best_config(view, choice.chosen)
        lines = verl_overrides(overrides)
        run_hint = f"ppotune train best_config.yaml --nproc {view.attrs.get('nproc') or 'N'}"
    else:  # exactly what the trial ran, less what a trial adds for itself (trainer.verl_engine.adapter.run_overrides)
        config = verl.run_file(overrides)
        if engine_python is None:
            del config["ppotune"]["python"]  # ppotune train --engine verl then runs the --engine-python it is given
        lines = config["overrides"]
        run_hint = f"ppotune train --engine verl best_config.yaml --engine-python {shlex.quote(engine_python or 'PY')}"
    if validate_verl:
        from tuner.results.verl_validate import validate_overrides

        validate_overrides(lines, python=engine_python)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "best_config": out / "best_config.yaml",
        "verl_overrides": out / "verl_overrides.txt",
        "verl_command": out / "verl_command.sh",
        "why": out / "why.md",
    }
    r = trial_row(view, choice.chosen)
    header = (
        f"# ppotune export: study {comment_safe(view.name)}, trial #{choice.chosen} ({choice.pick}, "
        f"headroom {pct(headroom)}):\n"
        + (f"# {comment_safe(view.algorithm_warning)}.\n" if view.algorithm_warning else "")
        + f"# {r['throughput']:.1f} tokens/s/GPU, peak {gb(r['peak_memory_gb'])} GB. See why.md.\n"
        + (
            f"# Confirmed: {describe(choice.confirmed)}.\n"
            if choice.confirmed is not None and choice.unconfirmed is None
            else "# Unconfirmed: the figure of one short trial (see why.md).\n"
        )
        + f"# Check it on your data: ppotune validate best_config.yaml --steps 20 {_study_args(view)}\n"
        f"# Run it: {comment_safe(run_hint)}\n"
    )
    files["best_config"].write_text(header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    files["verl_overrides"].write_text("".join(line + "\n" for line in lines))
    files["verl_command"].write_text(_verl_command(view, choice, lines, python=engine_python or "python", note=note))
    os.chmod(files["verl_command"], 0o755)
    files["why"].write_text(why_md(view, choice, overrides, lines))
    return ExportResult(choice=choice, files=files, overrides=lines, note=note)
