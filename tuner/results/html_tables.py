"""The report's tables (knobs vs the baseline, the Pareto configs, every trial, the confirmation, the token
lengths) and the cell formats they and the page's sections share (:mod:`tuner.results.html`)."""

from __future__ import annotations

import html
from typing import Any, Optional

import pandas as pd

from trainer.contracts import PHASES, short_knob
from tuner.results.analysis import LENGTH_KEYS
from tuner.results.plots import STATUS_STYLE
from tuner.results.view import TIME_PREFIX, StudyView, missing

__all__ = [
    "fmt",
    "esc",
    "ci_text",
    "dur_text",
    "knob_value_table",
    "front_table",
    "all_trials_table",
    "confirmation_table",
    "lengths_table",
]


def fmt(v: Any, spec: str = ".2f") -> str:
    return "–" if missing(v) else format(v, spec)


def esc(v: Any) -> str:
    return html.escape(str(v))


def ci_text(r: Any, spec: str = ".1f") -> str:
    """A trial row's 90% throughput interval, ``low–high``; ``–`` when the trial has none."""
    lo, hi = r.get("throughput_ci_low"), r.get("throughput_ci_high")
    return "–" if missing(lo) or missing(hi) else f"{format(lo, spec)}–{format(hi, spec)}"


def dur_text(s: Optional[float]) -> str:
    if missing(s):
        return "–"
    return f"{s / 3600:.2f} h" if s >= 7200 else f"{s / 60:.1f} min" if s >= 120 else f"{s:.1f} s"


def knob_value_table(view: StudyView, numbers: list[int]) -> str:
    base_n = [int(n) for n in view.trials.loc[view.trials["baseline"], "number"]]
    cols = list(dict.fromkeys(base_n + numbers))
    params = {n: view.trial(n).params for n in cols}
    knobs = view.knobs
    head = "".join(f"<th>#{n}{' (baseline)' if n in base_n else ''}</th>" for n in cols)
    rows = []
    for k in knobs:
        ref = params[base_n[0]].get(k) if base_n else None
        cells = []
        for n in cols:
            v = params[n].get(k)  # absent: a conditional knob this trial did not use
            cls = ' class="diff"' if base_n and n not in base_n and v != ref else ""
            cells.append(f"<td{cls}>{'–' if v is None else esc(v)}</td>")
        rows.append(f'<tr><th class="knob" title="{esc(k)}">{esc(short_knob(k))}</th>{"".join(cells)}</tr>')
    return f'<table class="t"><tr><th>knob</th>{head}</tr>{"".join(rows)}</table>'


def front_table(view: StudyView, numbers: list[int]) -> str:
    df = view.trials.set_index("number")
    phase_head = "".join(f"<th>{p}</th>" for p in PHASES)
    head = (
        "<tr><th rowspan=2>trial</th><th rowspan=2>throughput<br>tokens/s/GPU</th>"
        "<th rowspan=2>90% interval</th><th rowspan=2>steps</th><th rowspan=2>CV</th>"
        "<th rowspan=2>peak memory<br>GB (objective)</th><th colspan=2>external sampler</th>"
        "<th colspan=3>in-process</th><th rowspan=2>step s</th>"
        f"<th colspan={len(PHASES)}>median seconds per phase</th></tr>"
        "<tr><th>peak GB</th><th>source</th><th>allocated</th><th>reserved</th><th>RSS</th>"
        f"{phase_head}</tr>"
    )
    rows = []
    for n in numbers:
        r = df.loc[n]
        tag = " ★" if r["baseline"] else ""
        if not missing(r["confirm_of"]):
            tag += f"<br><span class='muted'>confirms #{int(r['confirm_of'])}</span>"
        phases = "".join(f"<td>{fmt(r.get(TIME_PREFIX + p), '.3f')}</td>" for p in PHASES)
        rows.append(
            f"<tr><td>#{n}{tag}</td><td>{fmt(r['throughput'], '.1f')}</td><td>{ci_text(r)}</td>"
            f"<td>{fmt(r['measured_steps'], '.0f')}</td><td>{fmt(r['throughput_cv'], '.1%')}</td>"
            f"<td><b>{fmt(r['peak_memory_gb'])}</b></td><td>{fmt(r['mem.external_peak_gb'])}</td>"
            f"<td>{esc(r['memory_source'] or '–')}</td><td>{fmt(r['mem.allocated_peak_gb'])}</td>"
            f"<td>{fmt(r['mem.reserved_peak_gb'])}</td><td>{fmt(r['mem.rss_peak_gb'])}</td>"
            f"<td>{fmt(r['step_s'], '.3f')}</td>{phases}</tr>"
        )
    return f'<table class="t">{head}{"".join(rows)}</table>'


def all_trials_table(view: StudyView) -> str:
    df = view.trials
    base_n = [int(n) for n in df.loc[df["baseline"], "number"]]
    base_p = view.trial(base_n[0]).params if base_n else {}
    rows = []
    for _, r in df.iterrows():
        n = int(r["number"])
        p = view.trial(n).params
        diff = (
            ", ".join(f"{short_knob(k)}={v}" for k, v in sorted(p.items()) if base_p.get(k) != v)
            if n not in base_n
            else "(base config)"
        )
        label, color, _ = STATUS_STYLE.get(r["status"], (r["status"], "#444444", "o"))
        extra = []
        if not pd.isna(r["inferred_from"]):
            extra.append(f"inferred from #{int(r['inferred_from'])}")
        if not pd.isna(r["confirm_of"]):
            extra.append(f"confirms #{int(r['confirm_of'])}")
        retry = view.record(n).retry_of
        if retry is not None:
            extra.append(f"re-run of interrupted #{retry}")
        if not pd.isna(r["duplicate_of"]):
            extra.append(f"same config as #{int(r['duplicate_of'])} (not re-run)")
        if r["error"]:
            extra.append((str(r["error"]).strip().splitlines() or [""])[0][:160])
        if r["notes"]:
            extra.append(r["notes"])
        flags = (" ★" if r["baseline"] else "") + (" ◆" if r["pareto"] else "")
        rows.append(
            f'<tr id="t{n}"><td>#{n}{flags}</td>'
            f'<td><span class="st" style="background:{color}">{esc(label)}</span></td>'
            f"<td>{fmt(r['throughput'], '.1f')}</td><td>{ci_text(r)}</td><td>{fmt(r['peak_memory_gb'])}</td>"
            f"<td>{esc(r['memory_source'] or '–')}</td>"
            f'<td>{dur_text(r["duration_s"])}</td><td class="small">{esc(diff)}</td>'
            f'<td class="small">{esc("; ".join(extra))}</td></tr>'
        )
    return (
        '<table class="t"><tr><th>trial</th><th>status</th><th>throughput</th><th>90% interval</th><th>peak GB</th>'
        "<th>mem source</th>"
        f"<th>cost</th><th>knobs (vs baseline)</th><th>notes / error</th></tr>{''.join(rows)}</table>"
    )


def confirmation_table(conf: dict) -> str:
    """The study's ``confirmation`` (tuner.rules.finalists.aggregate): one row per finalist, then the baseline."""
    rows = []
    for e in list(conf.get("finalists") or []) + [conf.get("baseline_result")]:
        if not e:
            continue
        base = e["number"] == conf.get("baseline")
        ci, tci = e.get("ratio_ci"), e.get("throughput_ci")
        trials = ", ".join(f"<a href='#t{n}'>#{n}</a>" for n in e.get("trials") or []) or "none"
        failed = f"{e.get('failed', 0)}" + (f" ({esc(', '.join(e.get('statuses') or []))})" if e.get("failed") else "")
        rows.append(
            f"<tr><td>#{e['number']}{' ★' if base else ''}</td><td><b>{fmt(e.get('ratio'))}x</b></td>"
            f"<td>{f'{ci[0]:.2f}–{ci[1]:.2f}' if ci else '–'}</td><td>{fmt(e.get('throughput'), '.1f')}</td>"
            f"<td>{f'{tci[0]:.1f}–{tci[1]:.1f}' if tci else '–'}</td><td>{fmt(e.get('peak_memory_gb'))}</td>"
            f"<td>{e.get('rounds', 0)}</td><td class='small'>{trials}</td><td>{failed}</td></tr>"
        )
    return (
        "<table class='t'><tr><th>trial</th><th>vs baseline<br>(paired ratios)</th><th>90% interval</th>"
        "<th>confirmed<br>tokens/s/GPU</th><th>90% interval</th><th>peak GB<br>(max)</th><th>rounds</th>"
        f"<th>re-runs</th><th>not ok</th></tr>{''.join(rows)}</table>"
    )


def lengths_table(seen: dict) -> str:
    head = "".join(f"<th>{k}</th>" for k in LENGTH_KEYS)
    rows = "".join(
        f"<tr><th class='knob'>{esc(part)}</th>" + "".join(f"<td>{fmt(figs.get(k), '.0f')}</td>" for k in LENGTH_KEYS)
        for part, figs in seen.items()
    )
    return f"<table class='t'><tr><th>tokens</th>{head}</tr>{rows}</table>"
