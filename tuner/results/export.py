"""``ppotune export``: pick one config from the feasible Pareto front and write it out.

Outputs (in ``--to``):
- ``best_config.yaml``  the complete training config: the study's base config with the
  chosen trial's overrides applied; ``ppotune train best_config.yaml`` runs it as is.
- ``verl_overrides.txt`` one Hydra ``key=value`` per line, verl keys only.
- ``verl_command.sh``    ``python -m verl.trainer.main_ppo`` with those overrides.
- ``why.md``             the chosen trial, the runner-up, the margin to the OOM boundary.

The pick never changes the algorithm: only the trial's overrides (per-GPU knobs and
their derived keys) are applied; global settings stay as the base config has them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import pandas as pd
import yaml

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict, flatten
from trainer.contracts import DEFAULT_HEADROOM, ExitCode, Status, StorageError
from trainer.verl_engine.overrides import hydra_value, verl_overrides
from tuner.results.memory_findings import findings_md, memory_findings
from tuner.results.view import StudyView, add_study_arguments, view_from_args
from tuner.stages.confirm import CONFIRMATION_ATTR, describe, entry_of, rank_confirmed
from tuner.stages.probe import WORST_CASE_ATTR, ProbeResult
from tuner.study.frame import Fit, headroom_filter, measured_feasible, missing, pareto_mask
from tuner.units import gb
from tuner.world import WorldPlan, production_overrides

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
    "add_arguments",
    "run",
]

PICKS = ("max-throughput", "min-memory", "knee")

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


class NoFit(StorageError):
    """No feasible trial satisfies the request (message is the one line the user sees)."""


@dataclasses.dataclass
class Choice:
    pick: str
    headroom: float
    device_gb: Optional[float]
    device_label: str
    limit_gb: Optional[float]  # peak memory must be <= this; None = no filter
    chosen: int  # trial number
    runner_up: Optional[int]
    ranking: list[int]  # feasible trials under the limit, best first by ``pick`` (confirmed: the confirmed ones)
    front: list[int]  # the feasible Pareto front under the limit
    warning: Optional[str] = None
    confirmation: Optional[dict] = None  # the study's ``confirmation`` attribute (tuner.stages.confirm.aggregate)
    confirmed: Optional[dict] = None  # the chosen config's confirmed figures (an entry of it), if it has them
    unconfirmed: Optional[str] = None  # why the pick does not rest on a confirmation (None: it does)
    left_out: list = dataclasses.field(default_factory=list)  # (number, why): confirmed configs not eligible
    worst_case: Optional[dict] = None  # the pick's worst-case probe (ProbeResult.to_dict), if it was probed


def _pct(f: float) -> str:
    return f"{f * 100:g}%"


def choose(view: StudyView, *, pick: str = "max-throughput", headroom: float = DEFAULT_HEADROOM) -> Choice:
    """The trial ``pick`` selects among feasible trials with peak <= (1 - headroom) x device memory.

    - ``max-throughput``: the fastest (ties: less memory);
    - ``min-memory``: the smallest peak (ties: faster);
    - ``knee``: the Pareto point furthest above the chord joining the front's ends, both
      objectives scaled to [0, 1] over the front (no point above it: the faster end).

    ``max-throughput`` on a study holding a confirmation (``ppotune search --confirm R``, on by default)
    ranks the confirmed configs instead, by the median of their paired throughput ratios to the baseline
    (:func:`tuner.stages.confirm.rank_confirmed`; still only trials under the limit, a confirmed peak over it or a
    failed re-run leaves a config out); without one, or with no eligible confirmed config, the single
    trials as above, and ``Choice.unconfirmed`` says why. Raises :class:`NoFit` when nothing qualifies.
    """
    if pick not in PICKS:
        raise ValueError(f"pick must be one of {PICKS}, got {pick!r}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"memory headroom must be in [0, 1), got {headroom}")
    df = view.trials
    if df.empty:
        raise NoFit(f"study {view.name!r} has no trials")
    feasible = measured_feasible(df)
    if not feasible.any():
        counts = ", ".join(f"{n} {s}" for s, n in df["status"].value_counts().items())
        raise NoFit(f"no feasible trial in study {view.name!r} ({counts})")
    fit = headroom_filter(df, view.attrs, headroom)
    device_gb, device_label, limit, under, warning = (
        fit.device_gb,
        fit.device_label,
        fit.limit_gb,
        fit.mask,
        fit.warning,
    )
    if not under.any():
        smallest = df.loc[feasible, "peak_memory_gb"].min()
        raise NoFit(
            f"no feasible trial keeps {_pct(headroom)} of {device_gb:.1f} GB free (smallest peak: {smallest:.1f} GB)"
        )
    front_mask = pareto_mask(df, among=under)
    cand = df.loc[under, ["number", "throughput", "peak_memory_gb"]].copy()
    if pick == "max-throughput":
        cand = cand.sort_values(["throughput", "peak_memory_gb", "number"], ascending=[False, True, True])
    elif pick == "min-memory":
        cand = cand.sort_values(["peak_memory_gb", "throughput", "number"], ascending=[True, False, True])
    else:
        front = df.loc[front_mask]
        t_lo, t_hi = front["throughput"].min(), front["throughput"].max()
        m_lo, m_hi = front["peak_memory_gb"].min(), front["peak_memory_gb"].max()
        t_span, m_span = (t_hi - t_lo) or 1.0, (m_hi - m_lo) or 1.0
        # height above the chord joining the front's two ends, both objectives scaled to [0, 1]:
        # the knee buys the most throughput per GB relative to the straight trade-off
        cand["score"] = (cand["throughput"] - t_lo) / t_span - (cand["peak_memory_gb"] - m_lo) / m_span
        cand = cand.sort_values(["score", "throughput", "number"], ascending=[False, False, True])
    ranking = [int(n) for n in cand["number"]]
    confirmation = view.attrs.get(CONFIRMATION_ATTR) or None
    left_out: list = []
    unconfirmed = None
    if pick != "max-throughput":
        unconfirmed = f"--pick {pick} ranks the search's single trials (the confirmation ranks by throughput)"
    elif not confirmation:
        unconfirmed = "the study holds no confirmation (ppotune search --confirm 0, or the search has not got there)"
    else:
        confirmed, left_out = rank_confirmed(confirmation, eligible=ranking, limit_gb=limit)
        if confirmed:
            ranking = [e["number"] for e in confirmed]
        else:
            unconfirmed = "no confirmed config is eligible: " + "; ".join(f"#{n} {why}" for n, why in left_out)
    # the worst case: a config whose probe (every prompt and response at its maximum) breaks the limit is
    # never recommended; the next one is taken
    probes = {int(k): ProbeResult.from_dict(v) for k, v in (view.attrs.get(WORST_CASE_ATTR) or {}).items()}
    broken = {n: probes[n] for n in ranking if n in probes and not _worst_case_holds(probes[n], limit)}
    left_out += [(n, f"worst case {_worst_case_text(p, limit)}") for n, p in broken.items()]
    ranking = [n for n in ranking if n not in broken]
    if not ranking:
        raise NoFit(
            "every config under the limit breaks it in its worst case (ppotune probe): "
            + "; ".join(f"#{n} {why}" for n, why in left_out)
        )
    chosen = ranking[0]
    params = {n: view.trial(n).params for n in ranking}
    runner_up = next((n for n in ranking[1:] if params[n] != params[chosen]), None)
    return Choice(
        pick=pick,
        headroom=headroom,
        device_gb=device_gb,
        device_label=device_label,
        limit_gb=limit,
        chosen=chosen,
        runner_up=runner_up,
        ranking=ranking,
        front=[int(n) for n in df.loc[front_mask, "number"]],
        warning=warning,
        confirmation=confirmation,
        confirmed=entry_of(confirmation, chosen),
        unconfirmed=unconfirmed,
        left_out=left_out,
        worst_case=probes[chosen].to_dict() if chosen in probes else None,
    )


def _worst_case_holds(probe: ProbeResult, limit_gb: Optional[float]) -> bool:
    """False when the probe ran out of memory or peaked over the limit. A probe that failed otherwise (a
    crash, a hang) measured nothing: why.md says so, it does not decide."""
    if probe.status == Status.OOM:
        return False
    return not (probe.fits and limit_gb is not None and (probe.peak_memory_gb or 0.0) > limit_gb)


def _worst_case_text(probe: ProbeResult, limit_gb: Optional[float]) -> str:
    if probe.status == Status.OOM:
        return f"ran out of memory in phase {probe.oom_phase or '?'}"
    if not probe.fits:
        return f"not measured (probe {probe.status.value}: {probe.error or 'no result'})"
    over = f" > {limit_gb:.3g} GB" if limit_gb is not None and (probe.peak_memory_gb or 0.0) > limit_gb else ""
    return f"peak {probe.peak_memory_gb:.3g} GB{over}"


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
    batch sizes (the study's ``target``, :mod:`tuner.world`; the trials ran them scaled), validated; a full
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


def nearest_oom(view: StudyView, number: int) -> Optional[tuple[int, list[tuple[str, Any, Any]]]]:
    """The OOM or inferred-OOM trial whose knobs differ least from trial ``number``'s.

    Returns (its number, [(knob, chosen value, OOM value), ...]) or None.
    """
    df = view.trials
    chosen = view.trial(number).params
    best = None
    for n in df.loc[df["status"].isin([Status.OOM, Status.INFERRED_OOM]), "number"]:
        other = view.trial(int(n)).params
        keys = sorted(set(chosen) | set(other))
        diff = [(k, chosen.get(k), other.get(k)) for k in keys if chosen.get(k) != other.get(k)]
        score = (len(diff), 0 if df.loc[df["number"] == n, "status"].item() == Status.OOM else 1, int(n))
        if best is None or score < best[0]:
            best = (score, int(n), diff)
    return None if best is None else (best[1], best[2])


# --------------------------------------------------------------------------- files
def _fmt(v: Any, spec: str = ".1f", unit: str = "") -> str:
    if missing(v):
        return "n/a"
    return f"{v:{spec}}{unit}"


def _row(view: StudyView, number: int) -> pd.Series:
    df = view.trials
    return df.loc[df["number"] == number].iloc[0]


def _why_md(view: StudyView, choice: Choice, overrides: dict, lines: list[str]) -> str:
    df = view.trials
    r = _row(view, choice.chosen)
    base = df.loc[df["baseline"]]
    out = [f"# Why trial #{choice.chosen}", ""]
    out.append(f"Study `{view.name}` ({len(df)} trials), storage `{view.storage.display}`.")
    target = view.attrs.get("target")
    if target:
        plan = WorldPlan.from_dict(target)
        out.append(
            f"Production world: {plan.target_nodes} x {plan.target_gpus_per_node} GPUs; {plan.describe()}. "
            "The exported config carries the production's world and global batch sizes."
        )
    if choice.limit_gb is not None:
        out.append(
            f"Pick **{choice.pick}** among feasible trials whose peak memory keeps {_pct(choice.headroom)} of the "
            f"{choice.device_label} free: peak <= {choice.limit_gb:.2f} GB. {len(df.loc[_under_limit(view, choice)])} "
            f"trials qualify; the Pareto front among them: {', '.join(f'#{n}' for n in choice.front)}."
        )
    else:
        out.append(f"Pick **{choice.pick}** among all feasible trials ({choice.warning}).")
    conf = choice.confirmation
    if choice.unconfirmed is None:
        out.append(
            f"The pick rests on a **confirmation**: the finalists and the baseline were re-run interleaved for "
            f"{conf.get('rounds')} rounds (each round rotated, so no config always ran first), and the ranking "
            "is the median of each finalist's throughput divided by the same round's baseline throughput."
            + ("" if conf.get("complete") else " The confirmation is incomplete (the search was interrupted).")
        )
    else:
        out.append(f"**Unconfirmed**: {choice.unconfirmed}. The figures below are single short trials.")
    out += ["", f"## Chosen: trial #{choice.chosen}", ""]
    if choice.confirmed is not None:
        c = choice.confirmed
        tci = c.get("throughput_ci")
        out += [
            f"Confirmed: **{describe(c)}**; median {_fmt(c.get('throughput'), '.1f')} tokens/s/GPU"
            + (f" (90% interval {tci[0]:.1f}–{tci[1]:.1f})" if tci else "")
            + f", peak {_fmt(c.get('peak_memory_gb'), '.2f')} GB over re-runs "
            + ", ".join(f"#{n}" for n in c.get("trials") or [])
            + ".",
            "",
        ]
    out += _metrics_table(
        view,
        [choice.chosen]
        + ([choice.runner_up] if choice.runner_up is not None else [])
        + ([int(base.iloc[0]["number"])] if not base.empty else []),
    )
    if not base.empty:
        b = base.iloc[0]
        if b["feasible"] and b["throughput"]:
            out += [
                "",
                f"Against the baseline (trial #{int(b['number'])}, the base config), single trials: "
                f"{r['throughput'] / b['throughput']:.2f}x throughput, "
                f"{r['peak_memory_gb'] / b['peak_memory_gb']:.2f}x peak memory.",
            ]
        else:
            out += ["", f"The baseline (trial #{int(b['number'])}, the base config) was `{b['status']}`."]
    if conf:
        out += ["", "## Confirmation: finalists re-run side by side with the baseline", ""]
        out += _confirmation_table(conf)
        out += [f"- #{n} not eligible: {why}" for n, why in choice.left_out]
    if r["notes"]:
        out += ["", f"Notes from the run: {r['notes']}"]
    if not overrides:
        out += ["", "The base config itself is the pick: there is no knob to change."]
    out += [
        "",
        "Knob values (the trial's overrides; the rest is the base config):",
        "",
        "| key | value | base config |",
        "|---|---|---|",
    ]
    base_flat = flatten(view.attrs.get("base_config") or {})
    for k, v in sorted(overrides.items()):
        out.append(f"| `{k}` | `{v}` | `{base_flat.get(k, 'n/a')}` |")

    out += ["", "## Runner-up", ""]
    up_confirmed = entry_of(conf, choice.runner_up) if choice.confirmed is not None else None
    if choice.runner_up is None:
        out.append("None: no other feasible config fits the limit.")
    elif up_confirmed is not None:
        d = (up_confirmed["throughput"] / choice.confirmed["throughput"] - 1.0) * 100
        out.append(
            f"Trial #{choice.runner_up}, confirmed: {describe(up_confirmed)}; median "
            f"{up_confirmed['throughput']:.1f} tokens/s/GPU ({d:+.1f}% vs chosen), peak "
            f"{_fmt(up_confirmed.get('peak_memory_gb'), '.2f')} GB."
        )
        a, b = choice.confirmed.get("ratio_ci"), up_confirmed.get("ratio_ci")
        if a and b and b[1] >= a[0]:
            out.append(
                "Their confirmed intervals overlap: the two are statistically close; more rounds "
                "(`ppotune search --confirm R` with a larger R, re-run on the same study) would separate them."
            )
        diff = _param_diff(view.trial(choice.chosen).params, view.trial(choice.runner_up).params)
        if diff:
            out += ["", "| knob | chosen | runner-up |", "|---|---|---|"]
            out += [f"| `{k}` | `{a}` | `{b}` |" for k, a, b in diff]
    else:
        u = _row(view, choice.runner_up)
        d_thr = (u["throughput"] / r["throughput"] - 1.0) * 100
        out.append(
            f"Trial #{choice.runner_up}: {u['throughput']:.1f} tokens/s/GPU ({d_thr:+.1f}% vs chosen), "
            f"peak {u['peak_memory_gb']:.2f} GB ({u['peak_memory_gb'] - r['peak_memory_gb']:+.2f} GB)."
        )
        cv = max(
            0.0 if missing(r["throughput_cv"]) else r["throughput_cv"],
            0.0 if missing(u["throughput_cv"]) else u["throughput_cv"],
        )
        if cv and abs(d_thr) < 200 * cv:
            out.append(
                f"The throughput gap is within 2x the measured step-time CV ({cv:.1%}): "
                "the two are statistically close; consider `ppotune search --confirm`."
            )
        diff = _param_diff(view.trial(choice.chosen).params, view.trial(choice.runner_up).params)
        if diff:
            out += ["", "| knob | chosen | runner-up |", "|---|---|---|"]
            out += [f"| `{k}` | `{a}` | `{b}` |" for k, a, b in diff]

    out += ["", "## Memory at the production world and in the worst case", ""]
    out += findings_md(memory_findings(view, choice.chosen), limit_gb=choice.limit_gb)
    out += ["", "## Margin to the OOM boundary", ""]
    peak = r["peak_memory_gb"]
    if choice.worst_case is not None:
        wc = ProbeResult.from_dict(choice.worst_case)
        out.append(
            f"Typical peak {peak:.3g} GB (the trial's own batches); worst case {_worst_case_text(wc, choice.limit_gb)} "
            f"(`ppotune probe`: one step with every prompt at {wc.prompt_length} and every response at "
            f"{wc.response_length} tokens, EOS ignored, on {wc.device or '?'} x{wc.world_size or '?'})."
        )
    else:
        out.append(
            "Worst case **not probed** (`ppotune search --probe 0`, or the search stopped before it): run "
            "`ppotune probe best_config.yaml` before a long job; the peak below is the trial's typical batches'."
        )
    if choice.device_gb is not None:
        free = choice.device_gb - peak
        out.append(
            f"Peak {peak:.2f} GB leaves {free:.2f} GB ({free / choice.device_gb:.0%}) "
            f"of the {choice.device_label} free."
        )
    near = nearest_oom(view, choice.chosen)
    if near is None:
        out.append("No trial ran out of memory: the boundary was not reached by the search.")
    else:
        n, diff = near
        o = _row(view, n)
        how = (
            "ran out of memory"
            if o["status"] == Status.OOM
            else f"was inferred to run out of memory (from #{o['inferred_from']})"
        )
        out.append(f"The nearest out-of-memory config is trial #{n}, which {how}; it differs in {len(diff)} knob(s):")
        out += ["", "| knob | chosen | OOM trial |", "|---|---|---|"]
        out += [f"| `{k}` | `{a}` | `{b}` |" for k, a, b in diff]
    out += [
        "",
        "## Files",
        "",
        "- `best_config.yaml`: `ppotune train best_config.yaml --nproc N`",
        "- `verl_command.sh` / `verl_overrides.txt`: append your verl run's own settings (model, data, batch sizes).",
        "",
        "```",
        *lines,
        "```",
        "",
    ]
    return "\n".join(out)


def _under_limit(view: StudyView, choice: Choice) -> pd.Series:
    """The trials ``choice`` could take (its headroom filter over the study's trials)."""
    return headroom_filter(view.trials, view.attrs, choice.headroom).mask


def _confirmation_table(conf: dict) -> list[str]:
    """The study's ``confirmation`` as a Markdown table: one row per finalist, then the baseline."""
    out = [
        "| trial | vs baseline (median of paired ratios) | 90% interval | confirmed tokens/s/GPU | 90% interval "
        "| peak GB (max) | re-runs | failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in list(conf.get("finalists") or []) + [conf.get("baseline_result")]:
        if not e:
            continue
        tag = " (baseline)" if e["number"] == conf.get("baseline") else ""
        ci, tci = e.get("ratio_ci"), e.get("throughput_ci")
        out.append(
            f"| #{e['number']}{tag} | {_fmt(e.get('ratio'), '.2f', 'x')} | "
            f"{f'{ci[0]:.2f}–{ci[1]:.2f}' if ci else 'n/a'} | {_fmt(e.get('throughput'), '.1f')} | "
            f"{f'{tci[0]:.1f}–{tci[1]:.1f}' if tci else 'n/a'} | {_fmt(e.get('peak_memory_gb'), '.2f')} | "
            f"{', '.join(f'#{n}' for n in e.get('trials') or []) or 'none'} | {e.get('failed', 0)} |"
        )
    return out


def _param_diff(a: dict, b: dict) -> list[tuple[str, Any, Any]]:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _metrics_table(view: StudyView, numbers: list[int]) -> list[str]:
    out = [
        "| trial | status | throughput (tokens/s/GPU) | CV | peak memory (GB) "
        "| external | allocated | reserved | RSS | step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in dict.fromkeys(numbers):
        r = _row(view, n)
        tag = " (baseline)" if r["baseline"] else ""
        ext = _fmt(r["mem.external_peak_gb"], ".2f") + (f" {r['memory_source']}" if r["memory_source"] else "")
        out.append(
            f"| #{n}{tag} | {r['status']} | {_fmt(r['throughput'], '.1f')} | {_fmt(r['throughput_cv'], '.1%')} | "
            f"{_fmt(r['peak_memory_gb'], '.2f')} | {ext} | {_fmt(r['mem.allocated_peak_gb'], '.2f')} | "
            f"{_fmt(r['mem.reserved_peak_gb'], '.2f')} | {_fmt(r['mem.rss_peak_gb'], '.2f')} | "
            f"{_fmt(r['step_s'], '.3f')} |"
        )
    return out


def verl_engine_of(view: StudyView):
    """How the study's verl trials ran (``--engine verl``), or None for ppotune's own trainer."""
    a = view.attrs
    if a.get("engine") != "verl":
        return None
    from tuner.trials.runners import VerlEngine

    return VerlEngine(
        python=a["engine_python"],
        base_overrides=tuple(a["engine_overrides"] or ()),
        steps=a["steps"],
        warmup=a["warmup"],
        memory_limit_gb=a.get("memory_limit_gb"),
    )


def _verl_command(view: StudyView, choice: Choice, lines: list[str], python: str = "python") -> str:
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
        f"# ppotune export: study {view.name}, trial #{choice.chosen} "
        f"({choice.pick}, headroom {_pct(choice.headroom)}).",
        "# The knobs below are per-GPU; they were measured with" + measured + ":",
        "#   " + " ".join(assumed),
        "# Append your run's own settings (model path, data files, batch sizes) as arguments: "
        "./verl_command.sh data.train_files=...",
        "set -euo pipefail",
        f"exec {shlex.quote(python)} -m verl.trainer.main_ppo \\",
    ]
    out += [f"    {shlex.quote(line)} \\" for line in lines]
    out.append('    "$@"')
    return "\n".join(out) + "\n"


def _study_args(view: StudyView) -> str:
    """``--storage URL --study NAME`` for a command line that reads this study again (password masked)."""
    return f"--storage {shlex.quote(view.storage.display)} --study {shlex.quote(view.name)}"


@dataclasses.dataclass
class ExportResult:
    choice: Choice
    files: dict[str, Path]
    overrides: list[str]


def write_export(
    view: StudyView,
    out_dir: str | Path,
    *,
    pick: str = "max-throughput",
    headroom: float = DEFAULT_HEADROOM,
    validate_verl: bool = False,
) -> ExportResult:
    """Choose, validate, then write the four files. Raises :class:`NoFit`/:class:`StorageError`
    (and verl_validate's errors with ``validate_verl``) before writing anything."""
    choice = choose(view, pick=pick, headroom=headroom)
    overrides = chosen_overrides(view, choice.chosen)
    verl = verl_engine_of(view)
    if verl is None:
        config = best_config(view, choice.chosen)
        lines = verl_overrides(overrides)
        run_hint = f"ppotune train best_config.yaml --nproc {view.attrs.get('nproc') or 'N'}"
    else:  # exactly what the trial ran, less what a trial adds for itself (trainer.verl_engine.adapter.run_overrides)
        config = verl.run_file(overrides)
        lines = config["overrides"]
        run_hint = f"ppotune train --engine verl best_config.yaml --engine-python {verl.python}"
    if validate_verl:
        from tuner.results.verl_validate import validate_overrides

        validate_overrides(lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "best_config": out / "best_config.yaml",
        "verl_overrides": out / "verl_overrides.txt",
        "verl_command": out / "verl_command.sh",
        "why": out / "why.md",
    }
    r = _row(view, choice.chosen)
    header = (
        f"# ppotune export: study {view.name}, trial #{choice.chosen} ({choice.pick}, headroom {_pct(headroom)}):\n"
        f"# {r['throughput']:.1f} tokens/s/GPU, peak {gb(r['peak_memory_gb'])} GB. See why.md.\n"
        + (
            f"# Confirmed: {describe(choice.confirmed)}.\n"
            if choice.confirmed is not None and choice.unconfirmed is None
            else "# Unconfirmed: the figure of one short trial (see why.md).\n"
        )
        + f"# Check it on your data: ppotune validate best_config.yaml --steps 20 {_study_args(view)}\n"
        f"# Run it: {run_hint}\n"
    )
    files["best_config"].write_text(header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False))
    files["verl_overrides"].write_text("".join(line + "\n" for line in lines))
    files["verl_command"].write_text(_verl_command(view, choice, lines, python=verl.python if verl else "python"))
    os.chmod(files["verl_command"], 0o755)
    files["why"].write_text(_why_md(view, choice, overrides, lines))
    return ExportResult(choice=choice, files=files, overrides=lines)


# --------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    add_study_arguments(parser)
    parser.add_argument(
        "--pick",
        choices=PICKS,
        default="max-throughput",
        help="which Pareto config: the fastest, the smallest, or the knee (default: max-throughput)",
    )
    parser.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_HEADROOM,
        metavar="F",
        help=(
            f"keep this fraction of device memory free: peak <= (1-F) x device memory (default {DEFAULT_HEADROOM:.2f})"
        ),
    )
    parser.add_argument("--to", metavar="DIR", help="where to write (default: the --out dir, else the current dir)")
    parser.add_argument(
        "--validate-verl",
        action="store_true",
        help="compose verl's own ppo_trainer config with the overrides; fail on an unknown or mistyped key",
    )


def _fail(message: str) -> int:
    print(f"ppotune export: {message}", file=sys.stderr)
    return ExitCode.USAGE


def run(args) -> int:
    if not 0.0 <= args.memory_headroom < 1.0:
        return _fail(f"--memory-headroom must be in [0, 1), got {args.memory_headroom}")
    if args.validate_verl:
        import importlib.util

        from tuner.results.verl_validate import verl_root

        root = verl_root()
        if root is None or not (root / "trainer" / "config" / "ppo_trainer.yaml").is_file():
            return _fail("--validate-verl needs verl installed (pip install --no-deps verl==0.9.1 hydra-core)")
        if importlib.util.find_spec("hydra") is None:
            return _fail("--validate-verl needs hydra-core installed (pip install hydra-core)")
    from tuner.results.verl_validate import VerlNotInstalled, VerlOverrideError

    try:
        view = view_from_args(args)
        to = args.to or args.out or "."
        result = write_export(view, to, pick=args.pick, headroom=args.memory_headroom, validate_verl=args.validate_verl)
    except (StorageError, VerlNotInstalled) as e:
        return _fail(str(e))
    except VerlOverrideError as e:
        return _fail(f"verl rejects an override: {e}")
    c = result.choice
    if c.warning:
        print(f"ppotune export: warning: {c.warning}", file=sys.stderr)
    r = _row(view, c.chosen)
    print(f"trial #{c.chosen} ({c.pick}): {r['throughput']:.1f} tokens/s/GPU, peak {gb(r['peak_memory_gb'])} GB")
    if c.confirmed is not None and c.unconfirmed is None:
        print(f"  confirmed: {describe(c.confirmed)}")
    else:
        print(f"  unconfirmed: {c.unconfirmed}")
    if args.validate_verl:
        print(f"verl accepts the {len(result.overrides)} overrides")
    for f in result.files.values():
        print(f"  {f}")
    return ExitCode.OK
