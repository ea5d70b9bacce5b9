"""verl on the CPU preset: each searched knob shown to act, in-run sweeps against separate runs, and a search's wall
time with and without in-run sweeps. Real verl 0.9.1 (the verl venv), one rank; run it under the heavy lock.

    python benchmarks/bench_verl_sweep.py knobs  [--python PY]              # -> benchmarks/data/verl_knobs.json
    python benchmarks/bench_verl_sweep.py alone  [--python PY] [--repeats 2]  # a setting in-run vs run alone
    python benchmarks/bench_verl_sweep.py search [--python PY] [--trials 6]   # search wall time, sweeps on vs off

* ``knobs``: one in-run sweep over each per-step key of ``search_spaces/verl_cpu.yaml`` (the micro-batches each pass
  cut follow the key), then two runs apart for gradient checkpointing (the update's peak and time), the second also
  with another ``critic.ppo_micro_batch_size_per_gpu`` (verl's critic cuts the same micro-batches: the key does
  nothing, which is why ``--engine verl`` refuses it). Writes what each key changed, for the knob table
  (``scripts/gen_verl_knob_table.py``).
* ``alone``: settings A and B measured in one run and each in a run of its own, interleaved ``--repeats`` times
  (the order rotated): the in-run throughput over the alone one, per setting, and the per-pass peaks.
* ``search``: ``ppotune search`` of the preset with ``search_spaces/verl_cpu.yaml``, ``--trials N`` (grid sampler, no
  confirmation or probe), ``sweep_settings`` 1 and 4: wall time, trials recorded, verl runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
DYN, BUDGET = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
LP_MICRO, LP_DYN = (
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
)
LP_BUDGET = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
CKPT, CRITIC_MICRO = "actor_rollout_ref.model.enable_gradient_checkpointing", "critic.ppo_micro_batch_size_per_gpu"


def cli(*args, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tuner.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def preset(tmp: Path, python: str) -> dict:
    r = cli("make-preset", "verl", "--out", tmp / "preset")
    assert r.returncode == 0, r.stderr
    overrides = yaml.safe_load((tmp / "preset" / "preset.yaml").read_text())["overrides"]
    return {"overrides": overrides, "ppotune": {"python": python, "steps": 3, "warmup": 1}}


def train(tmp: Path, run: dict, name: str) -> dict:
    path, result = tmp / f"{name}.yaml", tmp / f"{name}.json"
    path.write_text(yaml.safe_dump(run))
    t0 = time.time()
    r = cli("train", "--engine", "verl", path, "--nproc", 1, "--result", result)
    res = json.loads(result.read_text())
    res["bench_wall_s"] = time.time() - t0
    assert res["status"] == "ok", (res["status"], res["error"], r.stdout[-2000:])
    return res


def _passes(steps: list[dict], prefix: str) -> dict:
    keys = sorted({k for s in steps for k in s if k.startswith(prefix)})
    return {k[len(prefix) :]: statistics.median(s[k] for s in steps if k in s) for k in keys}


def knobs(tmp: Path, python: str) -> dict:
    base = preset(tmp, python)
    settings = [
        {MICRO: 1, LP_MICRO: 2},
        {MICRO: 4, LP_MICRO: 8},
        {DYN: True, LP_DYN: True, BUDGET: 128, LP_BUDGET: 256},
        {DYN: True, LP_DYN: True, BUDGET: 512, LP_BUDGET: 1024},
    ]
    sweep = train(tmp, {**base, "ppotune": {**base["ppotune"], "sweep": settings}}, "knobs_sweep")
    mb = [_passes([r for r in s["steps"] if not r["warmup"]], "ppotune/micro_batches/") for s in sweep["settings"]]
    off = train(tmp, {**base, "overrides": [*base["overrides"], f"{CKPT}=false", f"{CRITIC_MICRO}=1"]}, "ckpt_off")
    on = train(tmp, {**base, "overrides": [*base["overrides"], f"{CKPT}=true", f"{CRITIC_MICRO}=4"]}, "ckpt_on")
    peak = lambda res: res["summary"]["peak_memory_by_phase_gb"]["update_actor"]  # noqa: E731
    secs = lambda res: res["summary"]["timing_s"]["update_actor"]  # noqa: E731
    crit = [_passes(res["steps"], "ppotune/micro_batches/").get("update_critic") for res in (off, on)]
    say = {
        MICRO: f"update micro-batches {mb[0]['update_actor']:g} (1) -> {mb[1]['update_actor']:g} (4)",
        LP_MICRO: f"old-log-prob micro-batches {mb[0]['old_log_prob']:g} (2) -> {mb[1]['old_log_prob']:g} (8)",
        DYN: f"update micro-batches {mb[1]['update_actor']:g} (fixed 4) -> {mb[2]['update_actor']:g} (128 tokens)",
        BUDGET: f"update micro-batches {mb[2]['update_actor']:g} (128) -> {mb[3]['update_actor']:g} (512 tokens)",
        LP_BUDGET: f"old-log-prob micro-batches {mb[2]['old_log_prob']:g} (256) -> {mb[3]['old_log_prob']:g} (1024)",
        LP_DYN: f"old-log-prob micro-batches {mb[1]['old_log_prob']:g} (fixed 8) -> {mb[2]['old_log_prob']:g} (budget)",
        CKPT: f"update peak {peak(off):.3f} -> {peak(on):.3f} GB, {secs(off):.2f} -> {secs(on):.2f} s (off -> on)",
        CRITIC_MICRO: f"none: the critic update cut {crit[0]:g} (1) and {crit[1]:g} (4) micro-batches (critic.fsdp)",
    }
    return {"keys": say, "settings": mb, "runs_s": [sweep["bench_wall_s"], off["bench_wall_s"], on["bench_wall_s"]]}


def alone(tmp: Path, python: str, repeats: int) -> dict:
    base = preset(tmp, python)
    a, b = {MICRO: 1, LP_MICRO: 2}, {MICRO: 4, LP_MICRO: 8}
    with_ = lambda knobs: {**base, "overrides": [*base["overrides"], *(f"{k}={v}" for k, v in knobs.items())]}  # noqa: E731
    runs = [("sweep", {**base, "ppotune": {**base["ppotune"], "sweep": [a, b]}}), ("A", with_(a)), ("B", with_(b))]
    got: dict = {"sweep": [], "A": [], "B": []}
    for r in range(repeats):
        for name, run in runs[r % 3 :] + runs[: r % 3]:
            res = train(tmp, run, f"{name}_{r}")
            got[name].append(res)
            print(name, r, round(res["bench_wall_s"], 1), flush=True)
    out = {}
    for i, name in enumerate(("A", "B")):
        inrun = [s["settings"][i]["summary"]["throughput"] for s in got["sweep"]]
        solo = [s["summary"]["throughput"] for s in got[name]]
        out[name] = {
            "in_run_tok_s": inrun,
            "alone_tok_s": solo,
            "ratio": statistics.median(inrun) / statistics.median(solo),
            "in_run_peaks_gb": got["sweep"][-1]["settings"][i]["summary"]["peak_memory_by_phase_gb"],
            "alone_peaks_gb": got[name][-1]["summary"]["peak_memory_by_phase_gb"],
        }
    out["wall_s"] = {k: [round(x["bench_wall_s"], 1) for x in v] for k, v in got.items()}
    return out


def search(tmp: Path, python: str, trials: int) -> dict:
    base = preset(tmp, python)
    out = {}
    for settings in (4, 1):
        run = {**base, "ppotune": {"python": python, "sweep_settings": settings}}
        path = tmp / f"search_{settings}.yaml"
        path.write_text(yaml.safe_dump(run))
        t0 = time.time()
        args = ("search", path, "--engine", "verl", "--space", REPO / "search_spaces" / "verl_cpu.yaml")
        r = cli(*args, "--trials", trials, "--sampler", "grid", "--confirm", 0, "--probe", 0, "--nproc", 1,
                "--steps", 3, "--warmup", 1, "--out", tmp / f"out_{settings}")  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
        import optuna

        study = optuna.load_study(study_name=None, storage=f"sqlite:///{tmp / f'out_{settings}' / 'study.db'}")
        ok = [t for t in study.get_trials() if t.user_attrs.get("status") == "ok"]
        out[f"sweep_settings={settings}"] = {
            "wall_s": round(time.time() - t0, 1),
            "ok_trials": len(ok),
            "verl_runs": len(list((tmp / f"out_{settings}").glob("trials/*/result.json"))),
        }
        print(settings, out[f"sweep_settings={settings}"], flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["knobs", "alone", "search"])
    p.add_argument("--python", default=str(REPO / ".venv-verl" / "bin" / "python"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trials", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_verl_") as d:
        tmp = Path(d)
        if args.part == "knobs":
            got = knobs(tmp, args.python)
            data = {"date": time.strftime("%Y-%m-%d"), "command": "python benchmarks/bench_verl_sweep.py knobs", **got}
            (REPO / "benchmarks" / "data" / "verl_knobs.json").write_text(json.dumps(data, indent=1) + "\n")
        elif args.part == "alone":
            got = alone(tmp, args.python, args.repeats)
        else:
            got = search(tmp, args.python, args.trials)
    print(json.dumps(got, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
