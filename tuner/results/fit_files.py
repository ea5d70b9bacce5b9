"""What ``ppotune fit`` writes, read from its study (the study attribute ``fit``, :mod:`tuner.search.fit_probes`):
``fit.yaml`` (the complete config: the base config at the production world with the fitted sizes; for ``--engine verl``
the run file), ``verl_overrides.txt`` (the sizes as Hydra ``key=value`` lines; verl's run: every line of the run),
``fit.json`` (the table as data: what ``ppotune search --from-fit`` reads) and ``why.md`` (the table, per knob: the
value, its measured worst-case peak, the next value up and why it does not fit, the memory model's figure beside each).
The report of a fit's study shows the same table (:func:`fit_html`).

The study is data: every value read from it goes into a comment line escaped, into HTML escaped.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any, Optional

import yaml

from trainer.config import ConfigError, apply_overrides, config_from_dict, config_to_dict
from trainer.contracts import StorageError
from trainer.verl_engine.overrides import verl_overrides
from tuner.fit.answer import KnobAnswer, answer_values, knob_answers
from tuner.fit.boundary import FitState
from tuner.results.export import production_of, verl_engine_of
from tuner.results.html import page_head, trials_section
from tuner.results.view import StudyView
from tuner.study.schema import comment_safe

__all__ = ["FIT_FILES", "FitSummary", "fit_summary", "fit_md", "fit_html", "write_fit_files", "write_fit_report"]

#: what :func:`write_fit_files` writes
FIT_FILES = ("fit.yaml", "verl_overrides.txt", "fit.json", "why.md")


class FitSummary:
    """A fit read back from its study: the state, the limit, the table."""

    def __init__(self, attr: dict):
        try:
            self.state = FitState.from_dict(attr["state"])
            self.limit_gb = float(attr["limit_gb"])
            self.memory_gb = float(attr["memory_gb"])
            self.headroom = float(attr["headroom"])
        except (KeyError, TypeError, ValueError) as e:
            raise StorageError(f"the study's fit attribute is not a fit's: {type(e).__name__}: {e}") from None
        self.engine = str(attr.get("engine") or "ppotune")
        self.done = bool(attr.get("done"))
        self.rows: list[KnobAnswer] = knob_answers(self.state, limit_gb=self.limit_gb)
        self.values = answer_values(self.state)
        self.probe = self.state.answer_probe

    @property
    def complete(self) -> bool:
        """Every knob has a value and the answer ran within the limit."""
        return self.done and len(self.values) == len(self.rows) and self.probe is not None


def fit_summary(view: StudyView) -> Optional[FitSummary]:
    """The study's fit, or None for a study that is not a fit's."""
    attr = view.attrs.get("fit")
    return FitSummary(attr) if isinstance(attr, dict) else None


def _gb(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.3f}"


def _context(fit: FitSummary) -> str:
    return (
        f"Each probe is one worst-case step (every prompt at data.max_prompt_length, every response at "
        f"max_response_length, EOS ignored) under a real cap at the headroom's limit: {fit.headroom:.0%} of "
        f"{fit.memory_gb:.3f} GB kept free, {fit.limit_gb:.3f} GB per process. {fit.state.probes} probes."
    )


def fit_md(fit: FitSummary) -> list[str]:
    """The table as Markdown lines (why.md, the report's summary.md)."""
    out = [_context(fit), ""]
    out += [
        "| knob | what it sizes | base | **fitted** | worst-case peak GB (model) | next value up | why it does not fit "
        "(model GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in fit.rows:
        value = "none fits" if r.value is None else f"**{r.value}**"
        nxt = "–" if r.next_value is None else str(r.next_value)
        out.append(
            f"| `{comment_safe(r.key)}` | {comment_safe(r.role)} | {comment_safe(r.base)} | {value} | "
            f"{_gb(r.peak_gb)} ({_gb(r.predicted_gb)}) | {nxt} | {comment_safe(r.next_why)} "
            f"({_gb(r.next_predicted_gb)}) |"
        )
    if fit.probe is not None:
        out += ["", f"The fitted sizes together: probe #{fit.probe}, within the limit."]
    elif fit.rows:
        out += ["", "**The fit is not complete**: the fitted sizes have not run together within the limit yet."]
    return out


def fit_html(fit: FitSummary) -> list[str]:
    """The table as the report's section."""
    e = lambda v: html.escape(str(v))  # noqa: E731
    rows = []
    for r in fit.rows:
        value = "none fits" if r.value is None else f"<b>{e(r.value)}</b>"
        rows.append(
            f"<tr><td><code>{e(r.key)}</code></td><td>{e(r.role)}</td><td>{e(r.base)}</td><td>{value}</td>"
            f"<td>{_gb(r.peak_gb)} ({_gb(r.predicted_gb)})</td><td>{e('–' if r.next_value is None else r.next_value)}"
            f"</td><td class='small'>{e(r.next_why)} ({_gb(r.next_predicted_gb)})</td></tr>"
        )
    done = (
        f"The fitted sizes together: probe #{fit.probe}, within the limit."
        if fit.probe is not None
        else "The fit is not complete: the fitted sizes have not run together within the limit yet."
    )
    return [
        "<h2>The largest per-GPU sizes that fit at the worst case</h2>",
        f"<p class='sub'>{e(_context(fit))} In parentheses: the memory model's figure.</p>",
        "<table class='t'><tr><th>knob</th><th>what it sizes</th><th>base</th><th>fitted</th>"
        "<th>worst-case peak GB (model)</th><th>next value up</th><th>why it does not fit (model GB)</th></tr>"
        + "".join(rows)
        + "</table>",
        f"<p>{e(done)}</p>",
    ]


def _config(view: StudyView, fit: FitSummary, engine_python: Optional[str]) -> tuple[dict, list[str]]:
    """(fit.yaml's content, the override lines) for the fitted sizes."""
    verl = verl_engine_of(view, engine_python)
    if verl is not None:  # the run file the probes' runs were made of, at production's world, with the sizes
        config = verl.run_file(fit.values)
        if engine_python is None:
            del config["ppotune"]["python"]
        return config, config["overrides"]
    base = view.attrs.get("base_config")
    if not isinstance(base, dict):
        raise StorageError(f"study {view.name!r} has no base_config user attribute (contracts.md §3)")
    try:
        cfg = config_from_dict(apply_overrides(base, {**fit.values, **production_of(view)}), source="fit.yaml")
    except ConfigError as e:
        raise StorageError(f"the fitted config does not validate: {e}") from None
    return config_to_dict(cfg), verl_overrides(fit.values)


def _header(view: StudyView, fit: FitSummary) -> str:
    sizes = ", ".join(f"{r.role} {r.value}" for r in fit.rows)
    return (
        f"# ppotune fit: study {comment_safe(view.name)}: the largest per-GPU sizes whose worst-case step keeps "
        f"{fit.headroom:.0%} of {fit.memory_gb:.3f} GB free.\n# {comment_safe(sizes)}. See why.md.\n"
    )


def _why_md(view: StudyView, fit: FitSummary, lines: list[str]) -> str:
    out = [
        "# The largest per-GPU sizes that fit at the worst case",
        "",
        f"Study `{comment_safe(view.name)}`, storage `{comment_safe(view.storage.display)}`.",
        "",
    ]
    out += fit_md(fit)
    out += [
        "",
        "A pass's peak is its worst case only: a search (`ppotune search --from-fit DIR`) finds the fastest sizes "
        "at or below these.",
        "",
        "## Files",
        "",
        "- `fit.yaml`: the complete config with the fitted sizes (`ppotune train fit.yaml`)",
        "- `verl_overrides.txt`: " + ("; ".join(f"`{comment_safe(x)}`" for x in lines) or "none"),
        "- `fit.json`: the table as data (what `ppotune search --from-fit` reads)",
        "",
    ]
    return "\n".join(out)


def write_fit_files(view: StudyView, out_dir: str | Path, *, engine_python: Optional[str] = None) -> dict[str, Path]:
    """Write the four files of a complete fit into ``out_dir`` (:class:`StorageError` when the study holds no
    complete fit: nothing written)."""
    fit = fit_summary(view)
    if fit is None or not fit.complete:
        raise StorageError(f"study {view.name!r} holds no complete fit (run ppotune fit to the end)")
    config, lines = _config(view, fit, engine_python)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {name: out / name for name in FIT_FILES}
    files["fit.yaml"].write_text(_header(view, fit) + yaml.safe_dump(config, sort_keys=False))
    files["verl_overrides.txt"].write_text("".join(line + "\n" for line in lines))
    data: dict[str, Any] = {
        "study": view.name,
        "engine": fit.engine,
        "memory_gb": fit.memory_gb,
        "headroom": fit.headroom,
        "limit_gb": fit.limit_gb,
        "probes": fit.state.probes,
        "answer_probe": fit.probe,
        "values": fit.values,
        "knobs": [r.to_dict() for r in fit.rows],
    }
    files["fit.json"].write_text(json.dumps(data, indent=2) + "\n")
    files["why.md"].write_text(_why_md(view, fit, lines))
    return files


def write_fit_report(view: StudyView, fit: FitSummary, out_dir: Path) -> Path:
    """The report of a fit's study: report.html (the table, then every probe), summary.md, trials.csv; returns the
    page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    view.trials.to_csv(out_dir / "trials.csv", index=False)
    (out_dir / "summary.md").write_text(
        "\n".join([f"# ppotune report: study `{comment_safe(view.name)}`", "", *fit_md(fit), ""])
    )
    page = out_dir / "report.html"
    parts = [*page_head(view), *fit_html(fit), *trials_section(view), "</body></html>"]
    page.write_text("\n".join(parts), encoding="utf-8")
    return page
