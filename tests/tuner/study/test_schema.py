"""A hostile study: attributes and trial attributes of the wrong types, huge strings, names with newlines and shell
metacharacters, NaN/inf figures, unknown statuses, overrides that reach outside the space. ``report``, ``export``,
``validate`` and a resumed ``search`` read it as data: each ends in one line, or leaves the bad trial out with a
note; never a traceback, never an injected line in a file it writes, never an interpreter the study names.

The study is the hand-made demo (tests/support.py) in a real SQLite file, with hostile parts written through
Optuna's public API, as anyone who reaches the storage could."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from support import KNOBS, TINY_BASE, make_demo_study
from trainer.contracts import CONSTRAINT_KEY

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
INJECTED = ("rm -rf", "$(touch", "touch /tmp/pwned")
EVIL_NAME = "demo\n$(touch /tmp/pwned) #\nrm -rf ~"
EVIL_PYTHON = "/tmp/evil/bin/python"


def _params(micro: int = 4) -> dict:
    return {
        MICRO: micro,
        "actor_rollout_ref.actor.strategy": "fsdp2",
        "actor_rollout_ref.actor.fsdp_config.param_offload": False,
        "actor_rollout_ref.model.enable_gradient_checkpointing": True,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 8,
        "critic.ppo_micro_batch_size_per_gpu": 4,
    }


def _ok(**attrs) -> dict:
    """A measured trial's attributes, the fastest of the study unless told otherwise."""
    return {
        "status": "ok",
        "baseline": False,
        "overrides": _params(),
        "throughput": 9000.0,
        "peak_memory_gb": 40.0,
        "memory_source": "nvml",
        "duration_s": 50.0,
        "notes": [],
        **attrs,
    }


def _add(study: optuna.Study, attrs: dict, *, values=(9000.0, 40.0), state=TrialState.COMPLETE) -> None:
    study.add_trial(
        create_trial(
            state=state,
            values=list(values) if state == TrialState.COMPLETE else None,
            params=_params(),
            distributions=KNOBS,
            user_attrs=attrs,
            constraints={CONSTRAINT_KEY: -1.0} if state == TrialState.COMPLETE else None,
        )
    )


#: (what is wrong, the trial's attributes, its values): each is left out of the report and export with a note
HOSTILE_TRIALS = [
    ("an unknown status", _ok(status="hacked"), (9000.0, 40.0)),
    ("a status of the wrong type", _ok(status={"ok": True}), (9000.0, 40.0)),
    ("a throughput that is text", _ok(throughput="fast"), (9000.0, 40.0)),
    ("a NaN peak", _ok(peak_memory_gb=float("nan")), (9000.0, 40.0)),
    ("an infinite objective", _ok(), (math.inf, 40.0)),
    ("notes that are a number", _ok(notes=5), (9000.0, 40.0)),
    ("a memory record that is text", _ok(memory="lots"), (9000.0, 40.0)),
    ("an override outside the space", _ok(overrides={**_params(), "trainer.default_local_dir": "/etc"}), None),
    ("an override value with a command", _ok(overrides={**_params(), MICRO: "4\nrm -rf ~"}), None),
    ("a log path with a command", _ok(log_path="trials/1/train.log\n$(touch /tmp/pwned)"), None),
    ("a huge key", {**_ok(), "x" * 300: 1}, None),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    """One SQLite file: ``demo`` (hostile attributes and trials beside the demo's), ``verl`` (a verl study naming an
    interpreter), ``nobase`` (a base config of the wrong type) and a study whose name holds a command."""
    d = tmp_path_factory.mktemp("hostile")
    storage = f"sqlite:///{d / 'study.db'}"
    study = make_demo_study(storage)
    for k, v in {
        "nproc": "8; rm -rf ~",
        "steps": -1,
        "target": [1, 2],
        "confirmation": {"finalists": "all of them", "baseline": "zero"},
        "worst_case": {"0": {"status": "exploded"}, "x": 5},
        "memory_model": {"a": float("inf")},
        "space_path": "search_spaces/tiny.yaml\nrm -rf ~",
        "base_config_path": "x" * 1_000_000,
        "junk": float("nan"),
    }.items():
        study.set_user_attr(k, v)
    for _what, attrs, values in HOSTILE_TRIALS:
        _add(study, attrs, values=values or (9000.0, 40.0))
    _add(
        study,
        {**_ok(status="crash"), "error": "boom " * 1_000_000, "log_tail": "\x1b[31m" * 10_000},
        state=TrialState.FAIL,
    )
    verl = make_demo_study(storage, "verl")
    for k, v in {
        "engine": "verl",
        "engine_python": EVIL_PYTHON,
        "engine_overrides": ["actor_rollout_ref.model.path=/models/m", "data.train_files=/data/t.parquet"],
    }.items():
        verl.set_user_attr(k, v)
    make_demo_study(storage, "nobase").set_user_attr("base_config", "rm -rf ~")
    make_demo_study(storage, EVIL_NAME)
    return d


def _one_line(r: subprocess.CompletedProcess, command: str) -> str:
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith(f"ppotune {command}: note:")]
    assert len(lines) == 1, r.stderr[-2000:]
    return lines[0]


def _no_injection(root: Path) -> None:
    for f in root.rglob("*"):
        if f.is_file() and f.suffix != ".png":
            for line in f.read_text(errors="replace").splitlines():
                assert not line.lstrip().startswith(INJECTED), f"{f}: {line[:200]}"


def test_report_leaves_the_bad_trials_out_with_a_note(hostile, tmp_path, cli):
    r = cli("report", "--storage", hostile / "study.db", "--study", "demo", "--out", tmp_path / "report", timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("ppotune report: note:")]
    assert any("study attribute nproc ignored: '8; rm -rf ~' is not an integer" in n for n in notes), notes
    assert len(notes) == 6 and notes[-1].startswith("ppotune report: note: ... and "), notes  # 5 said, the rest counted
    html = (tmp_path / "report" / "report.html").read_text()
    assert "trial #14 skipped: status: &#x27;hacked&#x27; is not one of" in html
    for n, (what, _, _) in enumerate(HOSTILE_TRIALS, start=14):
        assert f"trial #{n} skipped" in html, what
    assert "9000.0" not in (tmp_path / "report" / "summary.md").read_text()  # no hostile figure made it in
    _no_injection(tmp_path / "report")


def test_export_picks_among_the_sound_trials_only(hostile, tmp_path, cli):
    r = cli("export", "--storage", hostile / "study.db", "--study", "demo", "--out", tmp_path / "x", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "x" / "best_config.yaml").read_text())
    assert config["trainer"]["default_local_dir"] is None  # the override outside the space never reached it
    assert (tmp_path / "x" / "why.md").read_text().splitlines()[0] == "# Why trial #11"  # the demo's own pick
    check = subprocess.run(["bash", "-n", str(tmp_path / "x" / "verl_command.sh")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    _no_injection(tmp_path / "x")


def test_export_never_writes_the_interpreter_the_study_names(hostile, tmp_path, cli):
    r = cli("export", "--storage", hostile / "study.db", "--study", "verl", "--out", tmp_path / "a", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    script = (tmp_path / "a" / "verl_command.sh").read_text().splitlines()
    code = [ln for ln in script if not ln.startswith("#")]
    assert "exec python -m verl.trainer.main_ppo \\" in code and not any(EVIL_PYTHON in ln for ln in code)
    assert any(EVIL_PYTHON in ln for ln in script if ln.startswith("#"))  # said, in a comment, not run
    run_file = yaml.safe_load((tmp_path / "a" / "best_config.yaml").read_text())
    assert "python" not in run_file["ppotune"]
    assert "--engine-python" in r.stderr
    r = cli(
        "export", "--storage", hostile / "study.db", "--study", "verl", "--out", tmp_path / "b",
        "--engine-python", "/opt/verl env/bin/python", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "exec '/opt/verl env/bin/python' -m verl.trainer.main_ppo \\"
        in (tmp_path / "b" / "verl_command.sh").read_text()
    )
    assert (
        yaml.safe_load((tmp_path / "b" / "best_config.yaml").read_text())["ppotune"]["python"]
        == "/opt/verl env/bin/python"
    )


@pytest.mark.parametrize("command", ["report", "export", "validate"])
def test_a_study_named_with_a_command_is_refused_in_one_line(hostile, tmp_path, cli, command):
    extra = {
        "report": ["--out", tmp_path / "r"],
        "export": ["--out", tmp_path / "e"],
        "validate": [TINY_BASE, "--steps", 2],
    }
    r = cli(command, *extra[command], "--storage", hostile / "study.db", "--study", EVIL_NAME, timeout=300)
    assert r.returncode == 2
    line = _one_line(r, command)
    assert "name" in line and "holds control characters" in line and "\n" not in line
    assert not (tmp_path / "r").exists() and not (tmp_path / "e").exists()


def test_validate_of_a_study_with_a_bad_base_config_is_one_line(hostile, cli):
    r = cli("validate", TINY_BASE, "--steps", 2, "--storage", hostile / "study.db", "--study", "nobase", timeout=300)
    assert r.returncode == 2 and "has no base_config" in _one_line(r, "validate")


def test_a_resumed_search_refuses_the_study_in_one_line(hostile, tmp_path, cli):
    r = cli(
        "search", TINY_BASE, "--space", "search_spaces/tiny_cpu.yaml", "--trials", 30, "--nproc", 2,
        "--storage", hostile / "study.db", "--study", "demo", "--out", tmp_path / "out", timeout=300,
    )  # fmt: skip
    assert r.returncode == 2
    line = _one_line(r, "search")
    assert line.startswith(
        "ppotune search: error: study 'demo' holds what a search cannot resume from: study attribute"
    )
    assert not (tmp_path / "out").exists()


def test_a_search_refuses_a_study_name_with_a_command(tmp_path, cli):
    r = cli(
        "search", TINY_BASE, "--space", "search_spaces/tiny_cpu.yaml", "--trials", 1, "--nproc", 2,
        "--study", "a\nb", "--out", tmp_path / "out", timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "holds control characters" in _one_line(r, "search")
    assert not (tmp_path / "out").exists()


def test_what_is_clipped_and_escaped():
    from tuner.study.schema import MAX_TEXT, comment_safe, read_trial

    assert comment_safe("a\nb\x1b$(x)") == "a\\x0ab\\x1b$(x)"
    t = create_trial(
        state=TrialState.FAIL,
        params={MICRO: 2},
        distributions={MICRO: CategoricalDistribution([1, 2])},
        user_attrs={"status": "crash", "error": "e" * (MAX_TEXT + 10)},
    )
    attrs, why = read_trial(t)
    assert why is None and len(attrs["error"]) < MAX_TEXT + 100 and attrs["error"].endswith("characters clipped)")
