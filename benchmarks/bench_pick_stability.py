"""Pick stability: does the demo pick the same config, at the same gain, however its single trials fall?

Runs the README's demo ``--runs`` times from scratch, each in a fresh directory (``ppotune fit configs/tiny_cpu.yaml
--nproc 2``, ``ppotune search ... --trials 10 --from-fit ppotune_fit``, finalists confirmed as by default, ``ppotune
export``), then measures each run's pick against the base config with ``ppotune validate`` (the harness that runs the
exported config and the study's baseline interleaved, the order rotating each round, ``--rounds`` rounds of
``--steps`` steps, and prints the median of the paired ratios with its 90% interval). The goal: the picks' measured
ratios within 5% of each other.

``--busy N``: the last N runs have a busy-loop on one core beside the search for its first ``--busy-s`` seconds (a
process outside the tuner's tree, as another job would be): the confirmation must wait it out, not claim from it.
Validation always runs on a quiet machine.

    flock /tmp/ppotune-heavy.lock python benchmarks/bench_pick_stability.py [--runs 5] [--busy 0] [--steps 12]
        [--rounds 4] [--out bench_out/pick_stability] [--json FILE]

Run it alone on the machine (it measures wall time and throughput).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "configs" / "tiny_cpu.yaml"
SPACE = REPO / "search_spaces" / "tiny_cpu.yaml"


def ppotune(*args: str, cwd: Path, log: Path, ok: tuple = (0,)) -> None:
    """``ppotune ARGS`` in ``cwd``, its output appended to ``log``; an exit code outside ``ok`` raises."""
    with log.open("a") as out:
        out.write(f"$ ppotune {shlex.join(args)}\n")
        out.flush()
        got = subprocess.run([sys.executable, "-m", "tuner.cli", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                             env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    if got.returncode not in ok:
        raise RuntimeError(f"ppotune {shlex.join(args)} exited {got.returncode} (see {log})")


def hog_for(seconds: float) -> threading.Thread:
    """A busy-loop on one core for ``seconds``, started outside this process's tree (through ``sh``'s background
    job, re-parented when ``sh`` exits), then killed."""
    cmd = f"{shlex.quote(sys.executable)} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout)

    def stop() -> None:
        time.sleep(seconds)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    t = threading.Thread(target=stop, daemon=False)
    t.start()
    return t


def one_run(k: int, out: Path, args: argparse.Namespace, busy: bool) -> dict:
    home = out / f"run{k}"
    home.mkdir(parents=True, exist_ok=False)
    log = home / "log.txt"
    t0 = time.monotonic()
    ppotune("fit", str(BASE), "--nproc", "2", cwd=home, log=log)
    hog = hog_for(args.busy_s) if busy else None
    t1 = time.monotonic()
    ppotune("search", str(BASE), "--space", str(SPACE), "--trials", str(args.trials), "--nproc", "2",
            "--from-fit", "ppotune_fit", "--out", "ppotune_out", cwd=home, log=log)  # fmt: skip
    t2 = time.monotonic()
    if hog is not None:
        hog.join()
    ppotune("export", "--out", "ppotune_out", cwd=home, log=log)
    t3 = time.monotonic()
    validate = ("validate", "--steps", str(args.steps), "--rounds", str(args.rounds), "--storage", "ppotune_out")
    ppotune(*validate, cwd=home, log=log, ok=(0, 1))  # 1 is validate's FAIL: a measurement too
    t4 = time.monotonic()
    found = sorted(home.glob("**/validate.json"))
    got = json.loads(found[-1].read_text())
    conf = _confirmation(home)
    return {
        "run": k,
        "busy": busy,
        "pick": got["trial"],
        "knobs": _knobs(home),
        "claim": {
            "ratio": got["study_figures"]["ratio"],
            "ratio_ci": got["study_figures"]["ratio_ci"],
            "confirmed": got["study_figures"]["confirmed"],
        },  # fmt: skip
        "confirmation": conf,
        "measured": {
            "ratio": got["measured"]["ratio"],
            "ratio_ci": got["measured"]["ratio_ci"],
            "ratios": got["measured"]["ratios"],
        },  # fmt: skip
        "seconds": {
            "fit": round(t1 - t0, 1),
            "search": round(t2 - t1, 1),
            "export": round(t3 - t2, 1),
            "validate": round(t4 - t3, 1),
        },  # fmt: skip
    }


def _knobs(home: Path) -> str:
    """The pick's overrides, as export wrote them for verl (one line)."""
    path = home / "ppotune_out" / "verl_overrides.txt"
    text = path.read_text() if path.is_file() else ""
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("#")]
    return " ".join(x.split(".")[-1] for x in lines if "n_gpus" not in x and "nnodes" not in x)


def _confirmation(home: Path) -> dict:
    """The study's confirmation attribute, in brief."""
    import optuna

    storage = f"sqlite:///{home / 'ppotune_out' / 'study.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    c = study.user_attrs.get("confirmation") or {}
    keep = ("rounds_run", "loaded_rounds", "leader", "separated", "suspect", "load_wait", "spent_s", "budget_s")
    return {**{k: c.get(k) for k in keep}, "finalists": [e["number"] for e in c.get("finalists") or []]}


def table(rows: list[dict]) -> str:
    out = ["run  busy  pick  claim (confirmation)        measured (validate)         rounds  suspect  search s"]
    for r in rows:
        c, m, conf = r["claim"], r["measured"], r["confirmation"]
        cci = f"[{c['ratio_ci'][0]:.2f}-{c['ratio_ci'][1]:.2f}]" if c.get("ratio_ci") else "[n/a]"
        mci = f"[{m['ratio_ci'][0]:.2f}-{m['ratio_ci'][1]:.2f}]" if m.get("ratio_ci") else "[n/a]"
        out.append(
            f"{r['run']:>3}  {'yes' if r['busy'] else 'no':>4}  #{r['pick']:<3}  {c['ratio'] or 0:.2f}x {cci:<18}  "
            f"{m['ratio'] or 0:.2f}x {mci:<18}  {conf.get('rounds_run')!s:>6}  "
            f"{'yes' if conf.get('suspect') else 'no':>7}  {r['seconds']['search']:>8.0f}"
        )
    got = [r["measured"]["ratio"] for r in rows if r["measured"]["ratio"]]
    if got:
        out.append(
            f"measured ratios: median {statistics.median(got):.3f}x, min {min(got):.3f}x, max {max(got):.3f}x, "
            f"spread (max/min - 1) {max(got) / min(got) - 1:.1%}"
        )
    for r in rows:
        out.append(f"run {r['run']}: #{r['pick']} {r['knobs']}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--busy", type=int, default=0, help="the last N runs with a busy-loop on one core beside the search")
    p.add_argument("--busy-s", type=float, default=40.0, help="how long the busy-loop runs from the search's start")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=12, help="ppotune validate --steps")
    p.add_argument("--rounds", type=int, default=4, help="ppotune validate --rounds")
    p.add_argument("--out", type=Path, default=REPO / "bench_out" / "pick_stability")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    out = args.out / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    rows = []
    for k in range(1, args.runs + 1):
        rows.append(one_run(k, out, args, busy=k > args.runs - args.busy))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows), flush=True)
    record = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "command": shlex.join([sys.executable, *sys.argv]),
        "rows": rows,
    }
    (out / "pick_stability.json").write_text(json.dumps(record, indent=2) + "\n")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
