"""The report's two documents: ``report.html`` (self-contained: inline CSS, base64 PNG
images, no links out) and ``summary.md`` (the same findings as text)."""

from __future__ import annotations

import base64
import datetime as _dt
from typing import Optional

import pandas as pd

from trainer.contracts import Status, short_knob
from tuner.results.analysis import (
    LENGTH_KEYS,
    MEMORY_ABS_TOL_GB,
    MEMORY_REL_TOL,
    THROUGHPUT_REL_TOL,
    ReportData,
    lengths_seen,
)
from tuner.results.html_tables import (
    all_trials_table,
    ci_text,
    confirmation_table,
    dur_text,
    esc,
    fmt,
    front_table,
    knob_value_table,
    lengths_table,
)
from tuner.results.memory_findings import findings_md, projection_text
from tuner.results.plots import STATUS_STYLE
from tuner.results.view import StudyView, pareto_front
from tuner.rules.finalists import CONFIRMATION_ATTR, describe, rounds_text
from tuner.rules.units import gb

__all__ = ["report_html", "summary_md", "page_head", "trials_section"]


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;\
color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:2px}h2{font-size:17px;margin-top:30px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}.cards{display:flex;gap:12px;flex-wrap:wrap;margin:14px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:170px;background:#fafafa}
.card .v{font-size:20px;font-weight:600}.card .k{font-size:12px;color:#666}
table.t{border-collapse:collapse;font-size:12px;margin:8px 0}\
table.t td,table.t th{border:1px solid #ddd;padding:3px 7px;text-align:right}
table.t th{background:#f3f3f3}table.t th.knob,table.t td.small{text-align:left}td.small{font-size:11px;max-width:420px}
td.diff{background:#fff3cd;font-weight:600}.st{color:#fff;border-radius:3px;padding:1px 6px;font-size:11px}
img{max-width:100%}.warn{background:#fff3cd;border:1px solid #e0c36b;padding:6px 10px;border-radius:4px}
.noeffect{color:#a94442;font-weight:600}.muted{color:#888}code{background:#f4f4f4;padding:0 3px}
"""


def _engine_label(attrs: dict) -> str:
    """What ran the trials: ppotune's own FSDP trainer, or verl's main_ppo (in which environment)."""
    if attrs.get("engine") == "verl":
        return f"verl's main_ppo (--engine verl, {attrs.get('engine_python')})"
    return "ppotune's FSDP trainer (--engine ppotune)"


def report_html(data: ReportData, images: dict[str, bytes]) -> str:
    """``report.html``: ``images`` maps pareto/importances/phases to PNG bytes, embedded inline."""
    view = data.view
    counts = _status_counts(view.trials)
    img = {k: "data:image/png;base64," + base64.b64encode(v).decode() for k, v in images.items()}
    parts = page_head(view)
    parts += _cards(data, counts)
    parts += _pareto_plot_section(data, img)
    parts += _baseline_section(data)
    parts += _confirmation_section(view.attrs.get(CONFIRMATION_ATTR))
    parts += _pareto_configs_section(view, img)
    parts += _lengths_section(view)
    parts += _memory_section(data)
    parts += _importances_section(data, img)
    parts += _no_effect_section(data)
    parts += _cost_section(data, counts)
    parts += trials_section(view)
    parts.append("</body></html>")
    return "\n".join(parts)


def _status_counts(df: pd.DataFrame) -> dict:
    """{status: number of trials}, most frequent first."""
    return df["status"].value_counts().to_dict() if not df.empty else {}


def page_head(view: StudyView) -> list[str]:
    """The page's head, title, what measured the trials on what, and the warnings about the study itself."""
    df = view.trials
    dev, dev_label = view.device_memory
    attrs = view.attrs
    device = attrs.get("device") or {}
    running = int((df["state"] == "RUNNING").sum()) if not df.empty else 0
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>ppotune report: {esc(view.name)}</title>"
        f"<style>{_CSS}</style></head><body>"
    ]
    parts.append(f"<h1>ppotune report: study <code>{esc(view.name)}</code></h1>")
    if view.algorithm_warning:  # before anything else: the figures below compare different algorithms
        parts.append(f"<p class='warn'><b>{esc(view.algorithm_warning)}.</b></p>")
    parts.append(
        f"<div class='sub'>{len(df)} trials · measured by {esc(_engine_label(attrs))}"
        f" · device {esc(device.get('name') or device.get('kind') or 'unknown')}"
        f" · {esc(dev_label)} · {attrs.get('nproc', '?')} processes · {attrs.get('steps', '?')} steps"
        f" ({attrs.get('warmup', '?')} warm-up) per trial · space {esc(attrs.get('space_path', '?'))}"
        f" · base config {esc(attrs.get('base_config_path', '?'))} · generated "
        f"{_dt.datetime.now().strftime('%Y-%m-%d %H:%M')}</div>"
    )
    if running:
        parts.append(
            f"<p class='warn'>The study is still running: {running} trial(s) in progress; this is a snapshot.</p>"
        )
    if dev is None:
        parts.append(
            "<p class='warn'>Device memory unknown: no headroom line, and export applies no headroom filter.</p>"
        )
    if view.notes:
        items = "".join(f"<li>{esc(n)}</li>" for n in view.notes)
        parts.append(
            f"<div class='warn'>Left out of this report (they do not fit the study's schema):<ul>{items}</ul></div>"
        )
    return parts


def _cards(data: ReportData, counts: dict) -> list[str]:
    """The figures at a glance: trials, the best under the headroom, its ratio to the baseline, the cost."""
    bvb = data.baseline_vs_best
    cost = data.cost
    cards = [
        (
            "trials",
            f"{len(data.view.trials)}",
            " · ".join(f"{n} {STATUS_STYLE.get(s, (s,))[0]}" for s, n in counts.items()),
        )
    ]
    if bvb.best is not None:
        best = bvb.best
        cards.append(
            (
                "best under headroom",
                f"#{int(best['number'])}",
                f"{best['throughput']:.1f} tokens/s/GPU · {gb(best['peak_memory_gb'])} GB",
            )
        )
    if bvb.confirmed is not None and bvb.confirmed.get("ratio") is not None:
        c = bvb.confirmed
        ci = f"90% interval {c['ratio_ci'][0]:.2f}–{c['ratio_ci'][1]:.2f}, " if c.get("ratio_ci") else ""
        cards.append(("best vs baseline, confirmed", f"{c['ratio']:.2f}x", f"{ci}{c.get('rounds')} interleaved rounds"))
    elif bvb.thr_ratio is not None:
        cards.append(
            ("best vs baseline", f"{bvb.thr_ratio:.2f}x", f"single trials, unconfirmed; memory {bvb.mem_ratio:.2f}x")
        )
    cards.append(
        (
            "search cost",
            dur_text(cost.trial_s),
            f"trial time; OOM {dur_text(cost.by_status.get(Status.OOM, 0.0))}",
        )
    )
    if cost.inferred:
        cards.append(
            (
                "saved by OOM inference",
                f"≈{dur_text(cost.saved_s)}",
                f"{cost.inferred} trials skipped ({cost.predicted} predicted by the memory model)",
            )
        )
    return [
        "<div class='cards'>"
        + "".join(
            f"<div class='card'><div class='k'>{esc(k)}</div><div class='v'>{esc(v)}</div>"
            f"<div class='k'>{esc(s)}</div></div>"
            for k, v, s in cards
        )
        + "</div>"
    ]


def _pareto_plot_section(data: ReportData, img: dict[str, str]) -> list[str]:
    return [
        "<h2>Pareto front: throughput vs peak memory</h2>",
        f"<img alt='Pareto plot' src='{img['pareto']}'>",
        "<p class='sub'>Every trial is plotted. Up: faster; left: smaller. Dark points are the Pareto front of "
        "feasible trials. The red line is the memory a config must fit (the cap the search ran under, else the "
        f"device's), the dashed line keeps {data.headroom:.0%} of it free. Failed trials have no real throughput "
        "(Optuna records a penalized 0), so they sit on the strip below: at the peak the memory sampler saw when "
        "there is one, else at their penalized memory value (hollow), else listed as 'no measurement'.</p>",
    ]


def _baseline_section(data: ReportData) -> list[str]:
    """The base config against export's pick: single trials, then the confirmation's figure or why there is none."""
    bvb = data.baseline_vs_best
    parts = ["<h2>Baseline vs best</h2>"]
    b, best = bvb.baseline, bvb.best
    if data.pick_error:
        parts.append(f"<p class='warn'>{esc(data.pick_error)}</p>")
    if b is None:
        parts.append("<p class='muted'>No baseline trial (user_attr baseline) in the study.</p>")
    elif best is not None:
        if bvb.thr_ratio is not None:
            parts.append(
                f"<p>The fastest config keeping {data.headroom:.0%} of memory free, "
                f"trial #{int(best['number'])}, runs at "
                f"<b>{best['throughput']:.1f}</b> tokens/s/GPU against the base config's {b['throughput']:.1f} "
                f"(trial #{int(b['number'])}): <b>{bvb.thr_ratio:.2f}x</b> throughput at "
                f"{bvb.mem_ratio:.2f}x the peak memory "
                f"({gb(best['peak_memory_gb'])} vs {gb(b['peak_memory_gb'])} GB).</p>"
            )
        else:
            parts.append(
                f"<p>The base config (trial #{int(b['number'])}) ended <b>{esc(b['status'])}</b>; "
                f"the fastest config that fits is trial #{int(best['number'])} "
                f"at {best['throughput']:.1f} tokens/s/GPU.</p>"
            )
    if best is not None and bvb.confirmed is not None:
        parts.append(
            f"<p>Confirmed side by side: trial #{int(best['number'])} runs at <b>{esc(describe(bvb.confirmed))}</b>"
            " (the median over rounds of its throughput divided by the same round's baseline throughput).</p>"
        )
    elif best is not None and data.pick is not None:
        parts.append(f"<p class='warn'>Unconfirmed: {esc(data.pick.unconfirmed)}. These are single short trials.</p>")
    return parts


def _confirmation_section(conf: Optional[dict]) -> list[str]:
    """The finalists re-run side by side with the baseline (nothing when the study holds no confirmation)."""
    if not conf:
        return []
    return [
        "<h2>Finalists confirmed side by side</h2>",
        f"<p class='sub'>The finalists (Pareto points under the headroom, trials whose throughput interval reaches "
        f"the best's) and the baseline re-run interleaved, rotated each round, until the leader separated from the "
        f"runner-up ({esc(rounds_text(conf))}). A figure is the geometric mean of paired ratios (throughput / the same "
        "round's baseline's), its 90% interval from the runs' own noise and the rounds' scatter; rounds under load "
        "are not claimed from. Export ranks by it. ★ baseline."
        + ("" if conf.get("complete") else " <b>Incomplete</b>: the search was stopped; re-run it to finish.")
        + "</p>",
        confirmation_table(conf),
    ]


def _pareto_configs_section(view: StudyView, img: dict[str, str]) -> list[str]:
    """The front's figures by memory source, its knob values and its step time by phase."""
    front = pareto_front(view.trials)
    parts = ["<h2>Pareto configs</h2>"]
    if front:
        parts.append(
            "<p class='sub'>Peak memory by source: the objective is the larger of the tuner's external sampler "
            "(NVML on GPU: includes NCCL buffers and the CUDA context; psutil RSS of the process tree on CPU) "
            "and the trial's own in-process peaks (torch allocator allocated/reserved, or RSS). ★ baseline.</p>"
        )
        parts.append(front_table(view, front))
        parts.append("<p class='sub'>Knob values (highlighted where they differ from the baseline):</p>")
        parts.append(knob_value_table(view, front))
        parts.append(f"<img alt='phases' src='{img['phases']}'>")
    else:
        parts.append("<p class='muted'>No feasible trial yet.</p>")
    return parts


def _lengths_section(view: StudyView) -> list[str]:
    """The token lengths the trials saw: a config tuned on them can lose on other data."""
    seen, n_seen = lengths_seen(view)
    parts = ["<h2>Sequence lengths the trials saw</h2>"]
    if seen:
        parts.append(
            f"<p class='sub'>Token lengths of the measured steps' prompts and responses (median over {n_seen} ok "
            "trials; max: the largest). A config tuned on these lengths can lose to the base config on other "
            "data: <code>ppotune validate</code> compares them with what it sees.</p>"
        )
        parts.append(lengths_table(seen))
    else:
        parts.append("<p class='muted'>No trial recorded its sequence lengths.</p>")
    return parts


def _importances_section(data: ReportData, img: dict[str, str]) -> list[str]:
    parts = ["<h2>Which knobs matter</h2>"]
    imp = data.importances
    parts.append(
        f"<p class='sub'>{esc(imp.message)}. Importance is computed on feasible trials only, separately "
        "for throughput and for peak memory.</p>"
    )
    parts.append(f"<img alt='importances' src='{img['importances']}'>")
    if imp.throughput:
        rows = "".join(
            f"<tr><th class='knob' title='{esc(k)}'>{esc(short_knob(k))}</th><td>{imp.throughput.get(k, 0):.2f}</td>"
            f"<td>{imp.memory.get(k, 0):.2f}</td></tr>"
            for k in sorted(imp.throughput, key=lambda k: -imp.throughput[k])
        )
        parts.append(f"<table class='t'><tr><th>knob</th><th>throughput</th><th>memory</th></tr>{rows}</table>")
    return parts


def _no_effect_section(data: ReportData) -> list[str]:
    """Each knob's verdict: a knob with no measurable effect only costs trials."""
    eff_rows = "".join(
        f"<tr><th class='knob' title='{esc(e.knob)}'>{esc(short_knob(e.knob))}</th>"
        f"<td class='small'>"
        f"<span class='{'noeffect' if e.verdict == 'no effect' else 'muted' if e.verdict == 'not isolated' else ''}'>"
        f"{esc(e.verdict)}</span></td><td class='small'>{esc(e.evidence)}</td></tr>"
        for e in data.effects
    )
    return [
        "<h2>Knobs that changed nothing measurable</h2>",
        "<p class='sub'>'no effect': every pair of ok trials differing in this knob alone moved throughput "
        f"by less than max({THROUGHPUT_REL_TOL:.0%}, 2×CV) and memory by less than "
        f"max({MEMORY_REL_TOL:.0%}, {MEMORY_ABS_TOL_GB} GB), or the trainer noted the knob is a no-op here. "
        "Drop such knobs from the space: they only cost trials.</p>",
        f"<table class='t'><tr><th>knob</th><th>verdict</th><th>evidence</th></tr>{eff_rows}</table>",
    ]


def _cost_section(data: ReportData, counts: dict) -> list[str]:
    """Trial time by status, the wall clock and what OOM inference saved."""
    cost = data.cost
    cost_rows = "".join(
        f"<tr><th class='knob'>{esc(STATUS_STYLE.get(s, (s,))[0])}</th><td>{counts.get(s, 0)}</td>"
        f"<td>{dur_text(v)}</td></tr>"
        for s, v in sorted(cost.by_status.items(), key=lambda kv: -kv[1])
    )
    return [
        "<h2>What the search cost</h2>",
        f"<table class='t'><tr><th>status</th><th>trials</th><th>trial time</th></tr>{cost_rows}"
        f"<tr><th class='knob'>total</th><td>{len(data.view.trials)}</td><td><b>{dur_text(cost.trial_s)}</b></td></tr>"
        "</table>",
        f"<p>Wall clock {dur_text(cost.wall_s)}. OOM inference skipped {cost.inferred} trial(s) "
        f"({cost.predicted} predicted by the memory model), saving "
        f"≈{dur_text(cost.saved_s)} ({esc(cost.saved_basis)} × {cost.inferred}).</p>",
    ]


def trials_section(view: StudyView) -> list[str]:
    return [
        "<h2>All trials</h2>",
        "<p class='sub'>★ baseline · ◆ Pareto front. Knobs are shown where they differ from the baseline.</p>",
        all_trials_table(view),
        f"<p class='sub'>Storage: <code>{esc(view.storage.display)}</code>. Open it live with "
        f"<code>optuna-dashboard {esc(view.storage.display)}</code>.</p>",
    ]


def _memory_section(data: ReportData) -> list[str]:
    """The memory model's predictions against the measured peaks, the pick at the production world, and the
    typical vs worst-case peaks of the probed configs."""
    f = data.memory
    if f is None:
        return []
    out = ["<h2>Memory: the model, the production world, the worst case</h2>"]
    if f.error:
        errs = sorted(r["error"] for r in f.rows if r["error"] is not None)
        p90 = errs[min(len(errs) - 1, int(0.9 * len(errs)))] if errs else None
        out.append(
            f"<p>A memory model (<code>tuner.memory_model</code>: analytic terms for the sharded model states, "
            f"the unsharded FSDP units, activations and logits per micro-batch, the generation cache; weights "
            f"fitted to this study's per-phase peaks) fitted on {f.num_samples} measured trials. Each trial "
            f"below is predicted by the model fitted on the <i>other</i> trials: error of the peak median "
            f"<b>{f.error['median']:.1%}</b>, 90th percentile {p90:.1%}, max <b>{f.error['max']:.1%}</b>. "
            f"The search did not launch {f.predicted_oom} candidate(s) it predicted over the memory limit by more "
            "than the max error (status <code>predicted_oom</code>); nearer the limit it launches them.</p>"
        )
        rows = "".join(
            f"<tr><td>#{r['number']}</td><td>{r['measured_gb']:.3f}</td><td>{r['predicted_gb']:.3f}</td>"
            f"<td>{fmt(100 * r['error'], '.1f') if r['error'] is not None else '-'}%</td></tr>"
            for r in sorted(f.rows, key=lambda r: r["number"] if r["number"] is not None else -1)
        )
        out.append(
            "<table class='t'><tr><th>trial</th><th>measured peak GB</th><th>predicted GB (held out)</th>"
            f"<th>error</th></tr>{rows}</table>"
        )
    else:
        out.append(f"<p class='muted'>No memory model: {esc(f.why_not)}.</p>")
    if f.pick is not None and f.pick["scaled"]:
        out.append(f"<p>The pick, {esc(projection_text(f.pick))}.</p>")
    if f.worst_case:
        rows = []
        for w in f.worst_case:
            probe = w["worst"]
            if probe.status == Status.OOM:
                worst = f"OOM in {esc(probe.oom_phase or '?')}"
            elif probe.fits:
                worst = f"{probe.peak_memory_gb:.3f}"
            else:
                worst = f"not measured ({esc(probe.status.value)})"
            rows.append(
                f"<tr><td>#{w['number']}</td><td>{fmt(w['typical_gb'], '.3f')}</td><td>{worst}</td>"
                f"<td>{probe.prompt_length} + {probe.response_length}</td></tr>"
            )
        out.append(
            "<p>Worst case (<code>ppotune probe</code>: one step with every prompt and every response at its "
            "maximum length, EOS ignored). Export never recommends a config whose worst case breaks the "
            "headroom.</p>"
            "<table class='t'><tr><th>trial</th><th>typical peak GB</th><th>worst-case peak GB</th>"
            f"<th>tokens (prompt + response)</th></tr>{''.join(rows)}</table>"
        )
    return out


def summary_md(data: ReportData) -> str:
    """``summary.md``: the report's findings as Markdown."""
    view = data.view
    df = view.trials
    dev, dev_label = view.device_memory
    counts = _status_counts(df)
    bvb = data.baseline_vs_best
    out = [f"# ppotune report: study `{view.name}`", ""]
    if view.algorithm_warning:
        out += [f"**{view.algorithm_warning}.**", ""]
    out += [
        f"- trials: {len(df)} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
        f"- measured by: {_engine_label(view.attrs)}",
        f"- memory: {dev_label}; headroom {data.headroom:.0%}",
    ]
    if bvb.best is not None:
        best = bvb.best
        out.append(
            f"- best under headroom: trial #{int(best['number'])}, {best['throughput']:.1f} tokens/s/GPU, "
            f"peak {gb(best['peak_memory_gb'])} GB"
        )
    if bvb.thr_ratio is not None:
        out.append(
            f"- vs baseline #{int(bvb.baseline['number'])}: {bvb.thr_ratio:.2f}x throughput, "
            f"{bvb.mem_ratio:.2f}x peak memory (single trials)"
        )
    if bvb.confirmed is not None:
        out.append(f"- confirmed: {describe(bvb.confirmed)}")
    elif data.pick is not None:
        out.append(f"- unconfirmed: {data.pick.unconfirmed}")
    seen, n_seen = lengths_seen(view)
    for part, figs in seen.items():
        out.append(
            f"- {part} lengths ({n_seen} trials): " + ", ".join(f"{k} {figs[k]:.0f}" for k in LENGTH_KEYS if k in figs)
        )
    if data.pick_error:
        out.append(f"- export: {data.pick_error}")
    c = data.cost
    out.append(
        f"- cost: {dur_text(c.trial_s)} of trials (OOM {dur_text(c.by_status.get(Status.OOM, 0.0))}, "
        f"hang {dur_text(c.by_status.get(Status.HANG, 0.0))}); {c.inferred} inferred OOM(s) saved "
        f"≈{dur_text(c.saved_s)}"
    )
    if data.memory is not None:
        out += findings_md(data.memory, limit_gb=data.pick.limit_gb if data.pick is not None else None)
    out += [
        "",
        "## Pareto front",
        "",
        "| trial | throughput (tokens/s/GPU) | 90% interval | peak memory (GB) | source | step (s) |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in df.loc[df["pareto"]].sort_values("throughput", ascending=False).iterrows() if not df.empty else []:
        out.append(
            f"| #{int(r['number'])}{' (baseline)' if r['baseline'] else ''} | {r['throughput']:.1f} | {ci_text(r)} | "
            f"{r['peak_memory_gb']:.2f} | {r['memory_source'] or '–'} | {fmt(r['step_s'], '.3f')} |"
        )
    imp = data.importances
    out += ["", "## Knob importances", "", imp.message + "."]
    if imp.throughput:
        out += ["", "| knob | throughput | memory |", "|---|---|---|"]
        out += [
            f"| `{k}` | {imp.throughput.get(k, 0):.2f} | {imp.memory.get(k, 0):.2f} |"
            for k in sorted(imp.throughput, key=lambda k: -imp.throughput[k])
        ]
    no = [e for e in data.effects if e.verdict == "no effect"]
    out += ["", "## No measurable effect", ""]
    out += [f"- `{e.knob}`: {e.evidence}" for e in no] or ["- none found"]
    out += ["", "Plots: pareto.png, importances.png, phases.png. Every trial: trials.csv. The page: report.html.", ""]
    return "\n".join(out)
