"""``ppotune export`` on the hand-built study of test_report.py (and on a real search when there is one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import KNOBS, make_demo_study, verl_root_or_skip
from support import REPO as ROOT
from trainer.config import flatten, load_config
from trainer.contracts import CONSTRAINT_KEY, Status
from tuner.cli import main
from tuner.rules import finalists as confirm


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("export_demo")
    make_demo_study(f"sqlite:///{d / 'study.db'}")
    return d


# --confirm 3 on the demo study: finalists #11, #3, #10 (the front under 72 GB, fastest first) and the
# baseline #0, interleaved; per round: (tokens/s/GPU, peak GB) of #11, #3, #10, #0
RERUNS = {
    11: [(2000.0, 63.0), (1900.0, 63.1), (1950.0, 62.9)],
    3: [(2200.0, 61.0), (2050.0, 61.2), (2150.0, 61.1)],
    10: [(1800.0, 47.0), (1700.0, 47.1), (1750.0, 47.0)],
    0: [(1500.0, 52.0), (1400.0, 52.0), (1450.0, 52.1)],
}
LENGTHS = {
    "prompt": {"p10": 12.0, "p50": 20.0, "p90": 41.0, "max": 64.0},
    "response": {"p10": 8.0, "p50": 16.0, "p90": 30.0, "max": 32.0},
}


def add_confirmation(study, reruns=None, *, rounds: int = 3) -> dict:
    """Re-runs of the finalists and the baseline written the way ``Search.confirm`` writes them (trials
    with ``confirm_of``, in the interleaved order), and the study attribute ``confirmation`` it stores."""
    reruns = RERUNS if reruns is None else reruns
    members = [n for n in reruns if n != 0]
    plan = confirm.schedule(members, 0, rounds)
    originals = {t.number: t for t in study.get_trials()}
    runs: dict = {n: [] for n in reruns}
    seen = {n: 0 for n in reruns}
    for r, order in enumerate(plan):
        for n in order:
            thr, peak = reruns[n][seen[n]]
            seen[n] += 1
            study.enqueue_trial(dict(originals[n].params))
            trial = study.ask(KNOBS)
            ua = dict(originals[n].user_attrs)
            status = "ok" if thr is not None else "oom"
            ua.update(
                status=status,
                confirm_of=n,
                baseline=False,
                throughput=thr,
                throughput_ci=None if thr is None else [thr * 0.97, thr * 1.03],
                measured_steps=5,
                peak_memory_gb=peak,
                lengths=LENGTHS,
            )
            for k, v in ua.items():
                trial.set_user_attr(k, v)
            trial.set_constraint(CONSTRAINT_KEY, -1.0 if thr is not None else 1.0)
            study.tell(trial, [thr or 0.0, peak])
            runs[n].append(confirm.Rerun(trial.number, status, thr, peak))
    agg = confirm.aggregate(baseline=0, finalists=members, rounds=rounds, headroom=0.1, runs=runs)
    study.set_user_attr(confirm.CONFIRMATION_ATTR, agg)
    return agg


@pytest.fixture(scope="module")
def confirmed_out(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("export_confirmed")
    add_confirmation(make_demo_study(f"sqlite:///{d / 'study.db'}"))
    return d


def _export(demo_out, tmp_path, *args) -> tuple[int, Path]:
    to = tmp_path / "exp"
    return main(["export", "--storage", str(demo_out), "--out", str(to), *args]), to


def _chosen(to: Path) -> int:
    first = (to / "why.md").read_text().splitlines()[0]
    return int(re.search(r"#(\d+)", first).group(1))


def test_export_picks_fastest_under_headroom(demo_out, tmp_path):
    rc, to = _export(demo_out, tmp_path)
    assert rc == 0
    # #4 is the fastest (2400) but peaks at 74.5 GB > 0.9 x 80 GB: #11 (2150, 63 GB) is chosen
    assert _chosen(to) == 11
    why = (to / "why.md").read_text()
    assert "Trial #3" in why  # runner-up: 2100
    assert "nearest out-of-memory config is trial #1" in why
    assert "enable_gradient_checkpointing" in why.split("Margin to the OOM boundary")[1]
    for name in ("best_config.yaml", "verl_overrides.txt", "verl_command.sh", "why.md"):
        assert (to / name).is_file()
    assert os.access(to / "verl_command.sh", os.X_OK)


def test_without_a_confirmation_export_says_unconfirmed(demo_out, tmp_path, capsys):
    rc, to = _export(demo_out, tmp_path)
    assert rc == 0
    why = (to / "why.md").read_text()
    assert "**Unconfirmed**: the study holds no confirmation" in why
    assert "# Unconfirmed: the figure of one short trial" in (to / "best_config.yaml").read_text()
    assert "unconfirmed: the study holds no confirmation" in capsys.readouterr().out


def test_a_leader_that_did_not_separate_says_so_in_why_md_the_report_and_the_summary(tmp_path, capsys):
    """#3 and #11 run within each other's noise in all 3 rounds: the claim carries its interval and says it was
    not separated after 3 rounds, in why.md, in the report's summary and in the search's summary."""
    from tuner.search.progress import confirm_summary

    close = {
        11: [(2150.0, 63.0), (2010.0, 63.1), (2160.0, 62.9)],
        3: [(2200.0, 61.0), (2000.0, 61.2), (2150.0, 61.1)],
        0: [(1500.0, 52.0), (1400.0, 52.0), (1450.0, 52.1)],
    }
    study = make_demo_study(f"sqlite:///{tmp_path / 'study.db'}")
    conf = add_confirmation(study, close)
    assert conf["rounds_run"] == 3 and conf["separated"] is False
    rc, to = _export(tmp_path, tmp_path)
    assert rc == 0
    leader = f"#{conf['leader']}"
    other = "#11" if leader == "#3" else "#3"
    said = f"not separated from {other} after 3 interleaved rounds"
    why = (to / "why.md").read_text()
    assert "3 of at most 3 rounds: the leader did not separate" in why and said in why
    assert re.search(r"90% interval \d\.\d\d–\d\.\d\d, 3 interleaved rounds; " + said, why)
    assert main(["report", "--storage", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    assert said in (tmp_path / "r" / "summary.md").read_text()
    capsys.readouterr()
    confirm_summary(study)
    out = capsys.readouterr().out
    assert "3 of at most 3 rounds: the leader did not separate" in out and said in out


def test_export_picks_the_confirmed_ratio_not_the_single_trial(confirmed_out, tmp_path, capsys):
    """#11 was the fastest single trial (2150 vs #3's 2100); side by side #3 is faster: its paired
    ratios 2200/1500, 2050/1400, 2150/1450 = 1.467, 1.464, 1.483 (geometric mean 1.471) beat #11's 1.345."""
    rc, to = _export(confirmed_out, tmp_path)
    assert rc == 0
    assert _chosen(to) == 3
    why = (to / "why.md").read_text()
    assert "The pick rests on a **confirmation**" in why and "Unconfirmed" not in why
    assert "Confirmed: **1.47x the baseline (90% interval " in why and ", 3 interleaved rounds)**" in why
    assert "median 2150.0 tokens/s/GPU" in why and "peak 61.20 GB" in why
    assert "Trial #11, confirmed: 1.35x the baseline" in why  # the runner-up, by its confirmed figure
    table = why.split("## Confirmation")[1].split("##")[0]
    assert "| #3 | 1.47x |" in table and "| #10 | 1.21x |" in table and "| #0 (baseline) | 1.00x |" in table
    header = (to / "best_config.yaml").read_text()
    assert "# Confirmed: 1.47x the baseline (90% interval" in header and "ppotune validate best_config.yaml" in header
    out = capsys.readouterr().out
    assert "trial #3 (max-throughput)" in out and "confirmed: 1.47x the baseline" in out
    got = flatten(yaml.safe_load((to / "best_config.yaml").read_text()))
    assert got["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 4  # #3's knobs
    assert got["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] == 4


def test_a_confirmed_peak_over_the_limit_or_a_failed_rerun_is_no_pick(tmp_path):
    reruns = {**RERUNS, 3: [(2200.0, 61.0), (2050.0, 73.0), (2150.0, 61.1)]}  # one re-run peaked over 72 GB
    make = make_demo_study(f"sqlite:///{tmp_path / 'a.db'}")
    add_confirmation(make, reruns)
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'a.db'}", "--out", str(tmp_path / "a")]) == 0
    assert _chosen(tmp_path / "a") == 11
    assert "#3 not eligible: its re-runs peaked at 73.00 GB" in (tmp_path / "a" / "why.md").read_text()
    reruns = {**RERUNS, 3: [(2200.0, 61.0), (None, 80.5), (2150.0, 61.1)]}  # one re-run ran out of memory
    add_confirmation(make_demo_study(f"sqlite:///{tmp_path / 'b.db'}"), reruns)
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'b.db'}", "--out", str(tmp_path / "b")]) == 0
    assert _chosen(tmp_path / "b") == 11
    assert "#3 not eligible: 1 of its re-runs did not end ok (oom)" in (tmp_path / "b" / "why.md").read_text()


def _probed(study, probes: dict) -> None:
    """The study attribute ``Search.probe_worst_case`` writes: ``{number: ProbeResult.to_dict()}``."""
    from tuner.trials.probe import WORST_CASE_ATTR, ProbeResult

    got = {}
    for n, (status, peak, phase) in probes.items():
        got[str(n)] = ProbeResult(
            Status(status), peak_memory_gb=peak, oom_phase=phase, prompt_length=64, response_length=32,
            device="cuda", world_size=8, memory_source="nvml",
        ).to_dict()  # fmt: skip
    study.set_user_attr(WORST_CASE_ATTR, got)


def test_a_pick_whose_worst_case_breaks_the_headroom_is_refused_and_the_next_taken(tmp_path):
    """Confirmed ranking #3 > #11 > #10 (test above); #3's worst case peaks at 75 GB > 72 GB (0.9 x 80 GB)
    and #11's runs out of memory: #10, whose worst case fits, is the pick; why.md shows typical vs worst."""
    study = make_demo_study(f"sqlite:///{tmp_path / 'w.db'}")
    add_confirmation(study)
    _probed(study, {3: ("ok", 75.0, None), 11: ("oom", None, "update_actor"), 10: ("ok", 60.5, None)})
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'w.db'}", "--out", str(tmp_path / "w")]) == 0
    assert _chosen(tmp_path / "w") == 10
    why = (tmp_path / "w" / "why.md").read_text()
    assert "#3 not eligible: worst case peak 75 GB > 72 GB" in why
    assert "#11 not eligible: worst case ran out of memory in phase update_actor" in why
    assert "Typical peak 47 GB (the trial's own batches); worst case peak 60.5 GB" in why
    # every config under the limit breaks it in its worst case: no pick, one line, exit 1
    _probed(study, {n: ("oom", None, "gen") for n in (0, 3, 5, 10, 11)})
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'w.db'}", "--out", str(tmp_path / "x")]) != 0


def test_an_unprobed_pick_says_so(demo_out, tmp_path):
    rc, to = _export(demo_out, tmp_path)
    assert rc == 0 and "Worst case **not probed**" in (to / "why.md").read_text()


def test_export_writes_the_production_world_not_the_trials(tmp_path):
    """A study whose trials ran 2 GPUs for a 2 x 8 job (``target``): best_config.yaml carries the job's
    world and global batch sizes; why.md says what the trials ran."""
    from tuner.rules.world import plan_world

    study = make_demo_study(f"sqlite:///{tmp_path / 'p.db'}")
    base = flatten(study.user_attrs["base_config"])
    production = {**base, "trainer.nnodes": 2, "trainer.n_gpus_per_node": 8, "data.train_batch_size": 128,
                  "actor_rollout_ref.actor.ppo_mini_batch_size": 64}  # fmt: skip
    plan = plan_world(production, trial_world=base["trainer.n_gpus_per_node"])
    study.set_user_attr("target", plan.to_dict())
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'p.db'}", "--out", str(tmp_path / "p")]) == 0
    got = flatten(yaml.safe_load((tmp_path / "p" / "best_config.yaml").read_text()))
    assert (got["trainer.nnodes"], got["trainer.n_gpus_per_node"]) == (2, 8)
    assert got["data.train_batch_size"] == 128 and got["actor_rollout_ref.actor.ppo_mini_batch_size"] == 64
    assert "Production world: 2 x 8 GPUs; trials run" in (tmp_path / "p" / "why.md").read_text()


def test_other_picks_and_a_tight_headroom_fall_back_and_say_so(confirmed_out, tmp_path):
    rc, to = _export(confirmed_out, tmp_path / "min", "--pick", "min-memory")
    assert rc == 0 and _chosen(to) == 5
    assert "**Unconfirmed**: --pick min-memory ranks the search's single trials" in (to / "why.md").read_text()
    # 25% headroom: limit 60 GB; of the confirmed configs only #10 (47 GB) and the baseline (52 GB) fit
    rc, to = _export(confirmed_out, tmp_path / "h25", "--memory-headroom", "0.25")
    assert rc == 0 and _chosen(to) == 10
    why = (to / "why.md").read_text()
    assert "#11 not eligible: not a feasible trial under the memory limit" in why
    assert "Confirmed: **1.21x the baseline" in why


def test_headroom_moves_the_pick(demo_out, tmp_path):
    picks = {}
    for h in ("0.05", "0.10", "0.25"):
        rc, to = _export(demo_out, tmp_path / h, "--memory-headroom", h)
        assert rc == 0
        picks[h] = _chosen(to)
    assert picks == {"0.05": 4, "0.10": 11, "0.25": 10}


def test_picks(demo_out, tmp_path):
    rc, to = _export(demo_out, tmp_path / "min", "--pick", "min-memory")
    assert rc == 0 and _chosen(to) == 5
    rc, to = _export(demo_out, tmp_path / "knee", "--pick", "knee")
    assert rc == 0 and _chosen(to) == 10  # 47 GB for 1900: the bend of the front


def test_nothing_fits(demo_out, tmp_path, capsys):
    rc, to = _export(demo_out, tmp_path, "--memory-headroom", "0.65")
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err == "ppotune export: error: no feasible trial keeps 65% of 80.0 GB free (smallest peak: 31.0 GB)"
    assert not to.exists()


def test_memory_cap_is_the_device(tmp_path, capsys):
    """A study run under --memory-limit-gb is judged against the cap, not the card."""
    make_demo_study(f"sqlite:///{tmp_path / 'study.db'}", memory_limit_gb=60.0)
    assert main(["export", "--storage", str(tmp_path), "--out", str(tmp_path / "e")]) == 0
    assert _chosen(tmp_path / "e") == 10  # limit 54 GB
    make_demo_study(f"sqlite:///{tmp_path / 'nodev.db'}", device_gb=None)
    assert main(["export", "--storage", f"sqlite:///{tmp_path / 'nodev.db'}", "--out", str(tmp_path / "n")]) == 0
    assert _chosen(tmp_path / "n") == 4  # no filter: the fastest
    assert "warning: device memory unknown" in capsys.readouterr().err


def test_device_memory_rules():
    from tuner.results.view import device_memory_gb

    h100 = {"kind": "cuda", "name": "H100", "memory_total_gb": 80.0}
    assert device_memory_gb({"device": h100, "memory_limit_gb": 40.0}) == (40.0, "memory cap 40 GB (--memory-limit-gb)")
    assert device_memory_gb({"device": h100, "memory_limit_gb": None})[0] == 80.0
    # on CPU the cap is an RLIMIT_DATA per rank, not comparable with RSS: the machine's RAM bounds the trial
    gb, label = device_memory_gb(
        {"device": {"kind": "cpu", "name": "Xeon", "memory_total_gb": 23.5}, "memory_limit_gb": 0.45}
    )
    assert gb == 23.5 and "rlimit" in label
    assert device_memory_gb({"device": {"kind": "cpu", "name": None, "memory_total_gb": None}}) == (
        None,
        "device memory unknown",
    )


def test_best_config_is_base_plus_overrides(demo_out, tmp_path):
    rc, to = _export(demo_out, tmp_path)
    assert rc == 0
    cfg = load_config(to / "best_config.yaml")  # loads and validates as is
    got = flatten(yaml.safe_load((to / "best_config.yaml").read_text()))
    base = flatten(yaml.safe_load((ROOT / "configs" / "tiny_cpu.yaml").read_text()))
    assert got["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 4
    assert got["actor_rollout_ref.actor.strategy"] == "fsdp2"
    assert got["critic.forward_micro_batch_size_per_gpu"] == 2  # the derived key too
    # global algorithm settings and the user's run length are untouched
    for key in (
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "algorithm.kl_ctrl.kl_coef",
        "algorithm.kl_ctrl.type",
        "trainer.total_training_steps",
        "ppotune.warmup_steps",
    ):
        assert got[key] == base[key], key
    assert cfg.trainer.n_gpus_per_node == 2


def test_verl_overrides_are_hydra_and_verl_only(demo_out, tmp_path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    rc, to = _export(demo_out, tmp_path)
    assert rc == 0
    lines = (to / "verl_overrides.txt").read_text().splitlines()
    assert lines and not any(line.startswith("ppotune.") for line in lines)
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(lines)}
    assert parsed["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 4
    assert parsed["actor_rollout_ref.model.enable_gradient_checkpointing"] is True
    assert parsed["actor_rollout_ref.actor.fsdp_config.param_offload"] is False
    assert parsed["actor_rollout_ref.actor.strategy"] == "fsdp2"
    cmd = (to / "verl_command.sh").read_text()
    assert "python -m verl.trainer.main_ppo \\" in cmd
    assert all(line in cmd for line in lines)
    r = subprocess.run(["bash", "-n", str(to / "verl_command.sh")], capture_output=True)
    assert r.returncode == 0


def test_hydra_value_round_trips():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.verl_engine.overrides import hydra_value

    values = [
        True,
        False,
        None,
        0,
        7,
        -3,
        0.5,
        1e-05,
        2.0,
        "fsdp2",
        "token-mean",
        "a b",
        "true",
        "it's",
        "/data/x.parquet",
        [1, 2],
        ["a", "b c"],
        "1",
        "null",
    ]
    lines = [f"k{i}={hydra_value(v)}" for i, v in enumerate(values)]
    parsed = [o.value() for o in OverridesParser.create().parse_overrides(lines)]
    assert parsed == values


def test_export_never_exports_ppotune_keys():
    from tuner.results.export import verl_overrides

    lines = verl_overrides({"ppotune.tiny.hidden_size": 64, "critic.fsdp.param_offload": True, "ppotune.device": "cpu"})
    assert lines == ["critic.fsdp.param_offload=true"]


# --------------------------------------------------------------------------- verl
def test_validate_verl_accepts_our_overrides(demo_out, tmp_path, capsys):
    pytest.importorskip("hydra")
    verl_root_or_skip()
    rc, to = _export(demo_out, tmp_path, "--validate-verl")
    assert rc == 0, capsys.readouterr().err
    assert "verl accepts the 7 overrides" in capsys.readouterr().out


def test_validate_verl_rejects_bad_keys():
    pytest.importorskip("hydra")
    from tuner.results.verl_validate import VerlOverrideError, validate_overrides

    verl_root_or_skip()
    good = [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "critic.fsdp.param_offload=true",
        "actor_rollout_ref.ref.fsdp_config.param_offload=false",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    ]
    assert validate_overrides(good)["critic.fsdp.param_offload"] is True
    with pytest.raises(VerlOverrideError) as e:
        validate_overrides(good + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpuu=4"])
    assert e.value.key == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpuu"
    with pytest.raises(VerlOverrideError) as e:  # verl 0.9.1 keeps the critic's FSDP knobs in critic.fsdp
        validate_overrides(["critic.model.fsdp_config.param_offload=true"])
    assert e.value.key.startswith("critic.model.fsdp_config")
    with pytest.raises(VerlOverrideError, match="expects bool"):
        validate_overrides(["actor_rollout_ref.actor.fsdp_config.param_offload=yes"])
    with pytest.raises(VerlOverrideError, match="expects int or null"):
        validate_overrides(["critic.ppo_micro_batch_size_per_gpu=two"])


def test_every_knob_of_the_default_space_is_a_key_verl_accepts():
    """The knobs the default space searches, exported as verl reads them (``+`` for the keys verl's YAML
    does not declare, such as fsdp_config.mixed_precision), compose into verl's own config."""
    pytest.importorskip("hydra")
    from tuner.results.export import verl_overrides
    from tuner.results.verl_validate import validate_overrides

    verl_root_or_skip()
    import yaml

    from support import REPO

    knobs = yaml.safe_load((REPO / "search_spaces" / "default.yaml").read_text())["knobs"]
    values = {
        k: (spec.get("choices") or [True])[0] if spec["type"] != "pow2" else spec["low"] for k, spec in knobs.items()
    }
    lines = verl_overrides(values)
    assert "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16" in lines
    seen = validate_overrides(lines)
    assert seen["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "bf16"
    assert seen["actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation"] is True


def test_every_rollout_engine_key_is_a_key_verl_accepts():
    """The vLLM space's knobs and fixed keys, and every rollout key of trainer.config, exported as verl reads
    them (``+`` for enable_sleep_mode, a field of verl's RolloutConfig its YAML does not declare)."""
    pytest.importorskip("hydra")
    from tuner.results.export import verl_overrides
    from tuner.results.verl_validate import validate_overrides

    verl_root_or_skip()
    import dataclasses

    import yaml

    from support import REPO
    from trainer.config import RolloutConfig

    space = yaml.safe_load((REPO / "search_spaces" / "rollout_vllm.yaml").read_text())
    defaults = RolloutConfig()
    values = {f"actor_rollout_ref.rollout.{f.name}": getattr(defaults, f.name) for f in dataclasses.fields(defaults)}
    values = {k: v for k, v in values.items() if v is not None}
    values.update({k: spec.get("low", True) for k, spec in space["knobs"].items()})
    values.update(space["fixed"])
    lines = verl_overrides(values)
    assert "+actor_rollout_ref.rollout.enable_sleep_mode=true" in lines
    seen = validate_overrides(lines)
    assert seen["actor_rollout_ref.rollout.name"] == "vllm" and seen["actor_rollout_ref.rollout.max_num_seqs"] == 4


def test_validate_verl_cli_names_the_key(tmp_path, capsys):
    """A study whose trial set a key verl lacks: export --validate-verl exits 2 naming it."""
    verl_root_or_skip()
    # the chosen trial (#11) sets a key our config has but verl 0.9.1 does not (a knob of its space, so the study
    # reads as sound: a trial's overrides outside its space are left out, tuner/study/schema.py)
    study = make_demo_study(f"sqlite:///{tmp_path / 'study.db'}", extra_overrides={11: {"trainer.seed": 7}})
    space = study.user_attrs["space"]
    study.set_user_attr("space", {**space, "knobs": {**space["knobs"], "trainer.seed": {"choices": [1, 7]}}})
    rc = main(["export", "--storage", str(tmp_path), "--out", str(tmp_path / "e"), "--validate-verl"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("ppotune export: error: verl rejects an override: trainer.seed:")
    assert not (tmp_path / "e").exists()


def test_validate_verl_without_verl(demo_out, tmp_path, capsys, monkeypatch):
    import tuner.results.verl_validate as vv

    monkeypatch.setattr(vv, "verl_root", lambda python=None: None)
    rc, _ = _export(demo_out, tmp_path, "--validate-verl")
    assert rc == 2
    err = capsys.readouterr().err
    assert "verl's config files not found" in err and "PPOTUNE_VERL_ROOT" in err and "--engine-python PY" in err
    assert "pip install" not in err  # verl is never installed beside ppotune for this (docs/verl.md)


# --------------------------------------------------------------------------- a real search, then a real run
def _has_train() -> bool:
    r = subprocess.run([sys.executable, "-m", "tuner.cli", "train", "--help"], cwd=ROOT, capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.slow
def test_exported_config_trains(real_search, tmp_path):
    if not _has_train():
        pytest.skip("`ppotune train` is not available yet")
    to = tmp_path / "exp"
    r = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "export", "--storage", str(real_search), "--out", str(to)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode == 2 and "no feasible trial" in r.stderr:
        pytest.skip(f"the small real search found nothing feasible: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    load_config(to / "best_config.yaml")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tuner.cli",
            "train",
            str(to / "best_config.yaml"),
            "--nproc",
            "2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--result",
            str(tmp_path / "result.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_report_and_export_never_import_torch():
    code = (
        "import sys, tuner.results.report, tuner.results.export, tuner.results.verl_validate; "
        "from tuner.cli import build_parser; build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_study_view_never_imports_matplotlib():
    """`ppotune search` prints its summary from the view: no plotting library for that."""
    code = (
        "import sys, tuner.results.view; "
        "assert 'matplotlib' not in sys.modules and 'torch' not in sys.modules, 'heavy import'"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
