"""The CLI reads one way (issue 27): ``--out`` is where a command writes, ``--storage``/``--study`` the study it
reads (default ./ppotune_out), ``-o KEY=VALUE`` an override; --version; every flag with help and its default;
"did you mean"; one error line; ``search --dry-run`` launches nothing and writes nothing; the headroom and pick
chosen once in the search are export's defaults. No trial is launched here."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import psutil
import pytest

from support import REPO, make_demo_study
from trainer.config import ConfigError, load_config
from tuner.cli import build_parser, main
from tuner.search import plan
from tuner.study.schema import read_study_attrs
from tuner.study.selection import SELECTION_ATTR, Selection, selection_of


def _err(capsys) -> str:
    return capsys.readouterr().err.strip()


# --------------------------------------------------------------------------- the parser itself
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ppotune 0.")


def _parsers(parser: argparse.ArgumentParser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                yield p
                yield from _parsers(p)


def test_every_flag_has_help_and_shows_its_default():
    """Every visible flag says what it does, and its help (as printed) names its default unless it is a switch
    or has none; the internal ones are hidden."""
    missing = []
    for p in _parsers(build_parser()):
        formatter = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction) or a.required:
                continue
            text = formatter._expand_help(a) if a.help else ""
            if not text or (a.nargs != 0 and "default" not in text):
                missing.append(f"{p.prog} {a.option_strings[-1]}: {text!r}")
    assert not missing, "\n".join(missing)
    train = next(p for p in _parsers(build_parser()) if p.prog == "ppotune train").format_help()
    assert "--serve" not in train and "--kill-grace" not in train


@pytest.mark.parametrize(
    "argv, says",
    [
        (["serach"], "ppotune: error: unknown command 'serach' (did you mean search?)"),
        (
            ["search", "--trails", "3"],
            "ppotune search: error: unrecognized arguments: --trails (did you mean --trials?)",
        ),
        (
            ["search", "b.yaml", "--space", "s.yaml", "--trials", "1", "--sampler", "tpee"],
            "(did you mean tpe?)",
        ),
        (["space", "chek"], "ppotune space: error: argument ACTION: invalid choice: 'chek'"),
        (["report", "--storge", "x"], "(did you mean --storage?)"),
    ],
)
def test_misspelt_commands_flags_and_choices_get_the_closest(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = _err(capsys)
    assert e.value.code == 2 and says in err and "\n" not in err, err
    assert err.count("ppotune") == 1 + err.count("did you mean ppotune"), err  # the program name once


def test_a_misspelt_config_key_says_where_it_came_from(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gp: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert str(e.value).startswith(f"{bad}: actor_rollout_ref.actor.ppo_micro_batch_size_per_gp: unknown key")
    assert "(did you mean actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu?)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs/tiny_cpu.yaml", ["data.train_batch_sise=4"])
    assert str(e.value).startswith("the command line (-o)") and "did you mean data.train_batch_size?" in str(e.value)
    with pytest.raises(ConfigError) as e:  # a value of the command line's, not the file's
        load_config(REPO / "configs/tiny_cpu.yaml", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=x"])
    assert str(e.value).startswith("the command line (-o) over ")


@pytest.mark.parametrize("command", ["check", "search", "space check"])
def test_o_overrides_everywhere_a_config_is_read(command, capsys):
    base, space = "configs/tiny_cpu.yaml", "search_spaces/tiny_cpu.yaml"
    argv = {
        "check": ["check", base],
        "search": ["search", base, "--space", space, "--trials", "2", "--dry-run", "--out", "/nonexistent/x"],
        "space check": ["space", "check", base, "--space", space],
    }[command]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        assert main([*argv, "-o", "data.train_batch_sise=4"]) == 2
    finally:
        os.chdir(cwd)
    err = _err(capsys)
    assert "the command line (-o)" in err and "did you mean data.train_batch_size?" in err and "\n" not in err, err


def test_space_check_reads_like_search_and_the_old_order_still_works(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["space", "check", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml"]) == 0
    new = capsys.readouterr()
    assert "(base configs/tiny_cpu.yaml, nproc 2)" in new.out and not new.err
    assert main(["space", "check", "search_spaces/tiny_cpu.yaml", "--base", "configs/tiny_cpu.yaml"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and old.err.count("\n") == 1 and "deprecated" in old.err


# ------------------------------------------------------------------- the study: --storage, default ./ppotune_out
@pytest.fixture
def demo_dir(tmp_path, monkeypatch) -> Path:
    """A finished demo study in ./ppotune_out, the current dir a fresh one (as after the README's demo)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ppotune_out").mkdir()
    study = make_demo_study(f"sqlite:///{tmp_path / 'ppotune_out' / 'study.db'}")
    study.set_user_attr(SELECTION_ATTR, Selection().to_attr())
    return tmp_path / "ppotune_out"


def test_bare_report_export_and_validate_find_the_demo(demo_dir, capsys):
    assert main(["report"]) == 0
    assert (demo_dir / "report" / "report.html").is_file()
    assert main(["export"]) == 0
    assert (demo_dir / "best_config.yaml").is_file() and (demo_dir / "why.md").is_file()
    assert main(["export", "--out", "ppotune_out"]) == 0  # the README's spelling: the same files
    assert not _err(capsys)
    from tuner.commands.validate import _inputs

    args = build_parser(only="validate").parse_args(["validate", "--steps", "6"])
    view, _, trial, _, _ = _inputs(args)  # CONFIG and the study found; no run launched
    assert Path(args.config) == (demo_dir / "best_config.yaml").resolve() and view.name == "demo" and trial == 11


def test_old_spellings_work_with_one_note(demo_dir, tmp_path, capsys):
    assert main(["export", "--out", str(demo_dir), "--to", str(tmp_path / "old")]) == 0
    err = _err(capsys)
    assert (tmp_path / "old" / "best_config.yaml").is_file()
    assert err == "ppotune export: note: --to DIR is deprecated and goes in the next release; use --out DIR"
    assert main(["report", "--to", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "report.html").is_file() and "deprecated" in _err(capsys)


def test_no_study_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["export"]) == 2
    assert _err(capsys) == (
        "ppotune export: error: no study to read: pass --storage URL or a `ppotune search` output dir "
        "(./ppotune_out holds none)"
    )
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- headroom and pick, chosen once
def test_selection_is_checked_when_read_back():
    attrs, notes = read_study_attrs({SELECTION_ATTR: {"pick": "rm -rf", "memory_headroom": 0.2}})
    assert SELECTION_ATTR not in attrs and notes and selection_of(attrs) == Selection()
    got = selection_of(read_study_attrs({SELECTION_ATTR: {"pick": "knee", "memory_headroom": 0.2}})[0])
    assert (got.pick, got.headroom, got.recorded) == ("knee", 0.2, True)
    with pytest.raises(ValueError, match="--memory-headroom must be in"):
        Selection(headroom=1.0)


def test_export_defaults_to_the_searchs_choice_and_says_how_to_confirm_another(demo_dir, capsys):
    import optuna

    study = optuna.load_study(study_name="demo", storage=f"sqlite:///{demo_dir / 'study.db'}")
    study.set_user_attr(SELECTION_ATTR, {"pick": "min-memory", "memory_headroom": 0.2})
    assert main(["export"]) == 0
    out = capsys.readouterr()
    assert "trial #" in out.out and "(min-memory)" in out.out and "note" not in out.err  # the search's choice
    assert main(["export", "--pick", "max-throughput", "--memory-headroom", "0.1"]) == 0
    err = _err(capsys)
    assert "was not confirmed or probed by the search (it ran for --pick min-memory --memory-headroom 0.2)" in err
    assert "ppotune search configs/tiny_cpu.yaml --space search_spaces/tiny_cpu.yaml --storage" in err
    assert "--study demo --trials 12 --steps 3 --warmup 1 --nproc 2 --pick max-throughput --memory-headroom 0.1" in err


def test_search_flags_record_the_selection():
    from tuner.commands.search import options_from_args

    args = build_parser(only="search").parse_args(
        ["search", "b.yaml", "--space", "s.yaml", "--trials", "3", "--pick", "knee", "--memory-headroom", "0.25"]
    )
    assert options_from_args(args).selection == Selection(pick="knee", headroom=0.25)


# --------------------------------------------------------------------------- search --dry-run
def _no_process(*a, **k):
    raise AssertionError("--dry-run started a process")


def test_dry_run_launches_nothing_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(subprocess.Popen, "__init__", _no_process)
    monkeypatch.setattr(os, "fork", _no_process)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    out = tmp_path / "out"
    argv = ["search", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml", "--trials", "10"]
    assert main([*argv, "--nproc", "2", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists() and not list(tmp_path.iterdir())
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert "52 configs after conditions and constraints, 6 knobs; fixed: none" in text
    assert "runs: 10 trials + 3 confirmation re-runs" in text and "+ 3 worst-case probes = 16 runs at most" in text
    assert "estimated wall time: about" in text and "a guess, not measured" in text


def test_dry_run_refuses_what_the_search_refuses(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    argv = ["search", "configs/tiny_cpu.yaml", "--space", "search_spaces/tiny_cpu.yaml", "--trials", "10"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--storage", "foo://x", "--dry-run"]) == 2
    assert _err(capsys).startswith("ppotune search: error: ") and not list(tmp_path.iterdir())
    assert main([*argv, "--out", str(tmp_path / "o"), "--finalists", "0", "--dry-run"]) == 2
    assert "--finalists must be >= 1" in _err(capsys) and not list(tmp_path.iterdir())


def test_the_estimate_uses_the_studys_own_trials():
    runs = plan.runs_of(trials=10, done=4, confirm=3, probe=3, finalists=3)
    assert (runs.trials, runs.reruns, runs.probes, runs.total) == (6, 12, 3, 21)
    assert plan.runs_of(trials=10, done=4, confirm=3, probe=3, finalists=1).reruns == 6  # 3 rounds x (1 + baseline)
    est = plan.estimate(runs, parallel=2, device="cpu", steps=8, durations=[10.0, 20.0, 30.0])
    assert est.measured and est.seconds == 20.0 * (3 + 12 + 3) and "median 20 s per run over 3 runs" in est.line()
    guess = plan.estimate(runs, parallel=1, device="cpu", steps=8)
    assert not guess.measured and "a guess, not measured" in guess.line()
    # a verl trial starts verl (Ray, its workers) every time: its guess is that start-up, not ours
    verl = plan.estimate(runs, parallel=1, device="cpu", steps=8, engine="verl")
    assert verl.per_run_s - guess.per_run_s == plan.VERL_STARTUP_GUESS_S["cpu"] - plan.STARTUP_GUESS_S["cpu"] > 0
    assert "verl: every trial starts verl" in verl.line()


def test_next_steps_name_the_study_when_it_is_not_the_default(tmp_path):
    args = argparse.Namespace(storage=None, study=None, report=False)
    default = plan.next_steps(args, None, Path("ppotune_out").resolve())
    assert default[1].startswith("next: ppotune export ") and "--storage" not in " ".join(default)
    other = plan.next_steps(args, None, tmp_path)
    assert f"ppotune validate --steps 20 --storage {tmp_path}" in other[2]
