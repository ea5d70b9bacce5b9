"""``why.md``, the note ``ppotune export`` writes beside the config: why this trial.

One function per section, in the order they appear: the pick and what it rests on, the chosen trial's
figures and knobs, the runner-up, the memory at the production world and in the worst case, the margin to
the OOM boundary, the files.
"""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from trainer.config import flatten
from trainer.contracts import Status
from tuner.results.memory_findings import findings_md, memory_findings
from tuner.results.pick import Choice, pct, trial_row, worst_case_text
from tuner.results.view import StudyView
from tuner.rules.finalists import describe, entry_of, rounds_text
from tuner.rules.world import WorldPlan
from tuner.study.frame import headroom_filter, missing
from tuner.trials.probe import ProbeResult

__all__ = ["why_md", "nearest_oom"]


def why_md(view: StudyView, choice: Choice, overrides: dict, lines: list[str]) -> str:
    """why.md for ``choice``: ``overrides`` are the chosen trial's keys, ``lines`` the verl overrides written."""
    out = _pick_section(view, choice)
    out += _chosen_section(view, choice)
    out += _confirmation_section(choice)
    out += _knobs_section(view, choice, overrides)
    out += _runner_up_section(view, choice)
    out += _memory_section(view, choice)
    out += _margin_section(view, choice)
    out += _files_section(lines)
    return "\n".join(out)


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


# --------------------------------------------------------------------------- the sections
def _pick_section(view: StudyView, choice: Choice) -> list[str]:
    """The title, the study, the production world, the rule that picked, and whether a confirmation backs it."""
    df = view.trials
    out = [f"# Why trial #{choice.chosen}", ""]
    if view.algorithm_warning:  # first: every figure below compares runs of different algorithms
        out += [f"**{view.algorithm_warning}.**", ""]
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
            f"Pick **{choice.pick}** among feasible trials whose peak memory keeps {pct(choice.headroom)} of the "
            f"{choice.device_label} free: peak <= {choice.limit_gb:.2f} GB. {len(df.loc[_under_limit(view, choice)])} "
            f"trials qualify; the Pareto front among them: {', '.join(f'#{n}' for n in choice.front)}."
        )
    else:
        out.append(f"Pick **{choice.pick}** among all feasible trials ({choice.warning}).")
    conf = choice.confirmation
    if choice.unconfirmed is None:
        out.append(
            f"The pick rests on a **confirmation**: the finalists and the baseline were re-run interleaved, "
            f"{rounds_text(conf)} (each round rotated, so no config always ran first); the ranking is each "
            "finalist's throughput divided by the same round's baseline throughput, with a 90% interval."
            + ("" if conf.get("complete") else " The confirmation is incomplete (the search was interrupted).")
        )
    else:
        out.append(f"**Unconfirmed**: {choice.unconfirmed}. The figures below are single short trials.")
    if conf and conf.get("load_wait"):
        out.append(_load_wait_text(conf["load_wait"]))
    return out


def _chosen_section(view: StudyView, choice: Choice) -> list[str]:
    """The chosen trial's confirmed figures, its metrics beside the runner-up's and the baseline's, and the
    ratio to the baseline."""
    df = view.trials
    r = trial_row(view, choice.chosen)
    base = df.loc[df["baseline"]]
    out = ["", f"## Chosen: trial #{choice.chosen}", ""]
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
    return out


def _confirmation_section(choice: Choice) -> list[str]:
    """The finalists' re-runs side by side with the baseline, and the confirmed configs left out."""
    conf = choice.confirmation
    if not conf:
        return []
    out = ["", "## Confirmation: finalists re-run side by side with the baseline", ""]
    out += _confirmation_table(conf)
    out += [f"- #{n} not eligible: {why}" for n, why in choice.left_out]
    suspect = conf.get("suspect")
    if suspect:
        screened = sorted({n for ns in (conf.get("screening") or {}).values() for n in ns})
        out += [
            "",
            f"The single trials were suspect: the first round measured without load contradicted them ({suspect['why']}"
            f"). So the finalists widened from {', '.join(f'#{n}' for n in suspect['first_finalists'])} to every "
            "config whose single trial was within that factor of a finalist's, and the rounds started again; the "
            f"first round's re-runs ({', '.join(f'#{n}' for n in screened) or 'none'}) were a screening, nothing is "
            "claimed from them.",
        ]
    if conf.get("rounds_run") and conf.get("spent_s") is not None and conf.get("budget_s") is not None:
        out += [
            "",
            f"The re-runs took {conf['spent_s']:.0f} s; a race that has not separated goes on past the rounds asked "
            f"while they take less than the search's own trials did ({conf['budget_s']:.0f} s).",
        ]
    return out


def _load_wait_text(wait: dict) -> str:
    """Why a confirmation stopped before its end: the load outlasted its wait; how to confirm later."""
    load = wait.get("load") or {}
    busy = f"other processes kept {load['cpu_others']:.2f} CPUs busy" if load.get("cpu_others") is not None else ""
    gpu = load.get("gpu_other_processes")
    busy += f"{', ' if busy else ''}{gpu} other process(es) on its GPUs" if gpu not in (0, None) else ""
    return (
        f"The confirmation stopped under load: after a re-run measured under load it waited {wait['waited_s']:.0f} s "
        f"(at most {wait['bound_s']:.0f} s) and the host was still busy ({busy or 'load'}). To confirm later, on a "
        f"quiet machine: `{wait['reconfirm']}` (it resumes the study; its trials are done, so it only confirms)."
    )


def _knobs_section(view: StudyView, choice: Choice, overrides: dict) -> list[str]:
    """The run's notes and the chosen trial's overrides against the base config."""
    r = trial_row(view, choice.chosen)
    out = []
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
    return out


def _runner_up_section(view: StudyView, choice: Choice) -> list[str]:
    """The runner-up by its confirmed figures when both have them, else by its single trial; whether the gap
    is within the noise, and the knobs that differ."""
    out = ["", "## Runner-up", ""]
    up_confirmed = entry_of(choice.confirmation, choice.runner_up) if choice.confirmed is not None else None
    if choice.runner_up is None:
        out.append("None: no other feasible config fits the limit.")
        return out
    # a confirmation whose rounds were all measured under load claims no figure: compare the single trials then
    claimed = up_confirmed is not None and up_confirmed.get("throughput") and choice.confirmed.get("throughput")
    if claimed:
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
    else:
        r, u = trial_row(view, choice.chosen), trial_row(view, choice.runner_up)
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
    return out


def _memory_section(view: StudyView, choice: Choice) -> list[str]:
    out = ["", "## Memory at the production world and in the worst case", ""]
    out += findings_md(memory_findings(view, choice.chosen), limit_gb=choice.limit_gb)
    return out


def _margin_section(view: StudyView, choice: Choice) -> list[str]:
    """The typical peak against the worst case and the device, and the nearest config that ran out of memory."""
    out = ["", "## Margin to the OOM boundary", ""]
    peak = trial_row(view, choice.chosen)["peak_memory_gb"]
    if choice.worst_case is not None:
        wc = ProbeResult.from_dict(choice.worst_case)
        out.append(
            f"Typical peak {peak:.3g} GB (the trial's own batches); worst case {worst_case_text(wc, choice.limit_gb)} "
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
        o = trial_row(view, n)
        how = (
            "ran out of memory"
            if o["status"] == Status.OOM
            else f"was inferred to run out of memory (from #{o['inferred_from']})"
        )
        out.append(f"The nearest out-of-memory config is trial #{n}, which {how}; it differs in {len(diff)} knob(s):")
        out += ["", "| knob | chosen | OOM trial |", "|---|---|---|"]
        out += [f"| `{k}` | `{a}` | `{b}` |" for k, a, b in diff]
    return out


def _files_section(lines: list[str]) -> list[str]:
    return [
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


# --------------------------------------------------------------------------- tables
def _fmt(v: Any, spec: str = ".1f", unit: str = "") -> str:
    if missing(v):
        return "n/a"
    return f"{v:{spec}}{unit}"


def _under_limit(view: StudyView, choice: Choice) -> pd.Series:
    """The trials ``choice`` could take (its headroom filter over the study's trials)."""
    return headroom_filter(view.trials, view.attrs, choice.headroom).mask


def _confirmation_table(conf: dict) -> list[str]:
    """The study's ``confirmation`` as a Markdown table: one row per finalist, then the baseline."""
    out = [
        "| trial | vs baseline (paired ratios) | 90% interval | confirmed tokens/s/GPU | 90% interval "
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
        r = trial_row(view, n)
        tag = " (baseline)" if r["baseline"] else ""
        ext = _fmt(r["mem.external_peak_gb"], ".2f") + (f" {r['memory_source']}" if r["memory_source"] else "")
        out.append(
            f"| #{n}{tag} | {r['status']} | {_fmt(r['throughput'], '.1f')} | {_fmt(r['throughput_cv'], '.1%')} | "
            f"{_fmt(r['peak_memory_gb'], '.2f')} | {ext} | {_fmt(r['mem.allocated_peak_gb'], '.2f')} | "
            f"{_fmt(r['mem.reserved_peak_gb'], '.2f')} | {_fmt(r['mem.rss_peak_gb'], '.2f')} | "
            f"{_fmt(r['step_s'], '.3f')} |"
        )
    return out
