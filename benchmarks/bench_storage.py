"""Many workers on one study: PostgreSQL directly and through Optuna's gRPC proxy.

W worker processes start together on an empty database and run ``ppotune search``'s own loop
(:class:`tuner.search.loop.Search`: study creation, the budget lock or the rank check, ask/tell,
dedupe, heartbeats, sweeps) with a budget of W x T trials. Each trial is answered by a
fake-fast runner through the public runner seam (:class:`SleepRunner`: it sleeps ``--sleep``
seconds and reports a throughput made from the config), so what is measured is the storage
and the loop, not a trainer. The database is a throwaway PostgreSQL server started here
(``tests/pg.py``: Debian's binaries, loopback, fsync on as a real server would run); the proxy
is ``ppotune storage-proxy`` in front of another database of the same server.

Printed per storage: trials/s sustained (counted trials / the span from the first trial's
start to the last one's end), the whole wall time (process start-up included), counted trials
against the budget (lost = budget - counted), configs measured twice, trials recorded
``over_budget`` or ``duplicate``, and the connections left on the server once every worker
exited.

    python benchmarks/bench_storage.py [--workers 8] [--trials-per-worker 30] [--sleep 0.05] [--json FILE]
    python benchmarks/bench_storage.py worker --storage URL --trials N ...   # one worker (the above starts them)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # tests/pg.py: the throwaway PostgreSQL server

import optuna  # noqa: E402

from trainer.config import apply_overrides, config_from_dict, config_to_dict, flatten  # noqa: E402
from trainer.contracts import STUDY_SCHEMA_VERSION, Status, TrialRecord, parse_storage  # noqa: E402
from tuner.rules.budget import counted  # noqa: E402
from tuner.search.loop import Search, SearchOptions  # noqa: E402
from tuner.search.policy import build_sampler  # noqa: E402
from tuner.search.session import TrialSession  # noqa: E402
from tuner.space import base_flat_config, load_space  # noqa: E402
from tuner.study import lifecycle as st  # noqa: E402
from tuner.study.storage import close_storage, open_storage  # noqa: E402
from tuner.trials.runners import TrialOutcome, TrialRequest  # noqa: E402

STUDY = "bench-storage"
BASE = REPO / "configs" / "tiny_cpu.yaml"
# 1024 x 61 = 62,464 configs: enough that 240 asks rarely collide (collisions are deduped, not counted)
SPACE = textwrap.dedent("""
    description: load-test space (rollout knobs only read by the fake runner)
    knobs:
      actor_rollout_ref.rollout.max_num_seqs: {type: int, low: 1, high: 1024}
      actor_rollout_ref.rollout.gpu_memory_utilization: {type: float, low: 0.3, high: 0.9, step: 0.01}
""")


@dataclass
class SleepRunner:
    """A fake-fast trial engine behind the public runner seam: sleeps, then reports a made-up
    but deterministic measurement of the config (so the sampler has something to learn)."""

    sleep_s: float
    name: str = "sleep"

    def run(self, request: TrialRequest, stop: threading.Event) -> TrialOutcome:
        if stop.wait(self.sleep_s):
            return TrialOutcome(Status.INTERRUPTED, TrialRecord(error="interrupted", engine=self.name))
        h = int(hashlib.sha256(repr(request.identity).encode()).hexdigest()[:8], 16)
        return TrialOutcome(
            Status.OK,
            TrialRecord(
                throughput=1000.0 + h % 1000,
                peak_memory_gb=1.0 + (h >> 10) % 100 / 10.0,
                duration_s=self.sleep_s,
                memory_source="fake",
                engine=self.name,
            ),
        )


# --------------------------------------------------------------------------- one worker
def worker(args: argparse.Namespace) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space_path = Path(args.space)
    space = load_space(space_path)
    base_nested, _ = base_flat_config(str(BASE), nproc=1)
    trial_base = config_to_dict(config_from_dict(apply_overrides(base_nested, {"trainer.total_training_steps": 2})))
    trial_flat = flatten(trial_base)
    spec = parse_storage(args.storage)
    lock = st.StudyLock(spec.lock_path)

    def setup(study: optuna.Study) -> None:
        study.enqueue_trial(space.baseline_params(trial_flat), user_attrs={"baseline": True})
        study.set_user_attr(st.SCHEMA_ATTR, STUDY_SCHEMA_VERSION)

    options = SearchOptions(
        trials=args.trials, seed=args.seed, heartbeat_s=args.heartbeat, grace_s=args.grace, sampler=args.sampler
    )
    sampler = build_sampler(options.sampler, seed=options.seed, n_trials=options.trials)
    study, storage, _ = st.open_study(
        spec, STUDY, lock, sampler=sampler, setup=setup, heartbeat_s=options.heartbeat_s, grace_s=options.grace_s
    )
    heartbeat = st.Heartbeat(storage, interval_s=options.heartbeat_s)
    search = Search(
        options=options,
        session=TrialSession(
            study=study,
            storage=storage,
            lock=lock,
            space=space,
            trial_base=trial_base,
            trial_flat=trial_flat,
            runner=SleepRunner(args.sleep),
            penalty_gb=100.0,
            trials_dir=Path(args.trials_dir),
            heartbeat=heartbeat,
        ),
    )
    heartbeat.start()
    try:
        search.run()
    finally:
        heartbeat.stop()
        close_storage(storage)
    print(json.dumps({"pid": os.getpid(), "lock": lock.kind, "stopped": search.stopped_reason}), flush=True)
    return 0


# --------------------------------------------------------------------------- the load test
def _start_proxy(url: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tuner.cli",
            "storage-proxy",
            "--storage",
            url,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        raise RuntimeError(f"storage-proxy did not start: {line}{proc.stdout.read()}")
    return proc, f"grpc://127.0.0.1:{port}"


def measure(kind: str, pg, args: argparse.Namespace, work: Path) -> dict:
    db = pg.create_database(f"bench_{kind}")
    url = pg.url(db)
    proxy = None
    storage_url = url
    if kind == "grpc":
        proxy, storage_url = _start_proxy(url)
    budget = args.workers * args.trials_per_worker
    work.mkdir(parents=True, exist_ok=True)
    space = work / "space.yaml"
    space.write_text(SPACE)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        "--storage",
        storage_url,
        "--trials",
        str(budget),
        "--sleep",
        str(args.sleep),
        "--space",
        str(space),
        "--trials-dir",
        str(work / "trials"),
        "--sampler",
        args.sampler,
    ]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [*cmd, "--seed", str(i)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for i in range(args.workers)
    ]
    outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    wall = time.monotonic() - t0
    failed = [(p.returncode, o[-2000:]) for p, o in zip(procs, outs) if p.returncode != 0]
    left_by_workers = pg.wait_connections(db, at_most=1 if proxy else 0)  # the proxy keeps its pool
    if proxy is not None:
        proxy.terminate()
        proxy.wait(timeout=30)
    left_after = pg.wait_connections(db, at_most=0)

    storage = open_storage(parse_storage(url), read_only=True)
    try:
        trials = optuna.load_study(study_name=STUDY, storage=storage).get_trials()
    finally:
        close_storage(storage)
    cnt = [t for t in trials if counted(t)]
    statuses = [TrialRecord.from_user_attrs(t.user_attrs).status for t in trials]
    configs = [tuple(sorted(t.params.items())) for t in cnt]
    starts = [t.datetime_start for t in cnt if t.datetime_start]
    ends = [t.datetime_complete for t in cnt if t.datetime_complete]
    span = (max(ends) - min(starts)).total_seconds() if starts and ends else float("nan")
    owners = {(TrialRecord.from_user_attrs(t.user_attrs).owner or {}).get("pid") for t in cnt}
    return {
        "storage": kind,
        "workers": args.workers,
        "budget": budget,
        "counted": len(cnt),
        "lost": budget - len(cnt),
        "configs_measured_twice": len(configs) - len(set(configs)),
        "over_budget": sum(s == Status.OVER_BUDGET for s in statuses),
        "duplicate": sum(s == Status.DUPLICATE for s in statuses),
        "unfinished": sum(not t.state.is_finished() for t in trials),
        "workers_that_ran_trials": len(owners),
        "trials_per_s": len(cnt) / span if span > 0 else float("nan"),
        "span_s": span,
        "wall_s": wall,
        "connections_left_by_workers": left_by_workers,
        "connections_left": left_after,
        "failed_workers": failed,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser(prog="bench_storage.py worker")
        p.add_argument("worker")
        p.add_argument("--storage", required=True)
        p.add_argument("--trials", type=int, required=True)
        p.add_argument("--sleep", type=float, default=0.05)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--space", required=True)
        p.add_argument("--trials-dir", required=True)
        p.add_argument("--sampler", default="tpe")
        p.add_argument("--heartbeat", type=float, default=2.0)
        p.add_argument("--grace", type=float, default=10.0)
        return worker(p.parse_args())

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--trials-per-worker", type=int, default=30)
    p.add_argument("--sleep", type=float, default=0.05, help="seconds each fake trial takes")
    p.add_argument("--storages", default="postgresql,grpc")
    p.add_argument("--sampler", default="tpe")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args()

    import tempfile

    from pg import ThrowawayPostgres

    rows = []
    with ThrowawayPostgres(durable=True) as pg, tempfile.TemporaryDirectory() as tmp:
        for kind in args.storages.split(","):
            rows.append(measure(kind, pg, args, Path(tmp) / kind))
    print(
        f"{args.workers} workers x {args.trials_per_worker} trials (fake {args.sleep:g} s each, sampler "
        f"{args.sampler}), throwaway PostgreSQL {pg.bindir.parent.name} on loopback, fsync on"
    )
    print(
        f"{'storage':<12}{'trials/s':>9}{'span s':>8}{'wall s':>8}{'counted':>9}{'lost':>6}{'twice':>7}"
        f"{'over_budget':>12}{'duplicate':>10}{'conns left':>11}"
    )
    for r in rows:
        print(
            f"{r['storage']:<12}{r['trials_per_s']:>9.1f}{r['span_s']:>8.1f}{r['wall_s']:>8.1f}"
            f"{r['counted']:>5}/{r['budget']:<3}{r['lost']:>6}{r['configs_measured_twice']:>7}"
            f"{r['over_budget']:>12}{r['duplicate']:>10}{r['connections_left']:>11}"
        )
        for code, out in r["failed_workers"]:
            print(f"  a worker failed ({code}): {out}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    ok = all(
        r["lost"] == 0 and r["configs_measured_twice"] == 0 and not r["failed_workers"] and r["unfinished"] == 0
        for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
