"""One rank of a cold PPO run: ``python -m trainer.rank.run CONFIG --rank-dir DIR`` (started by ``ppotune train``:
tuner/commands/train.py, trainer/launch/ranks.py).

:func:`rank_main`: :func:`trainer.rank.process.start_rank` (device, process group) ->
:func:`trainer.rank.trial.run_trial` (memory cap, data, models, steps -- the first ``ppotune.warmup_steps``
marked warm-up -- optional HF checkpoint) -> cleanup. A warm job (trainer/rank/serve.py) runs the same two
functions: ``start_rank`` once, ``run_trial`` per trial. Each rank writes ``<rank-dir>/rank<r>.json``: its
status (ok | oom | error), and on rank 0 the per-step metrics, rewritten after every step so a later failure
keeps what was measured. An OOM anywhere is caught, recorded, and the rank exits at once (code 3): its peers,
blocked in a collective, are then ended by the launcher, which reads the files (trainer.rank.process.fail).

torch is imported inside :func:`rank_main`, after the rank's signal handling is set: a failure while importing
is recorded like any other.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from trainer.launch.proc import die_with_parent, leave_rank, write_json_atomic
from trainer.rank.process import fail_rank, new_state, on_sigterm_write, start_rank
from trainer.rank.trial import run_trial

__all__ = ["rank_main"]


def rank_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trainer.rank.run")
    ap.add_argument("config")
    ap.add_argument("--rank-dir", required=True)
    args = ap.parse_args(argv)
    die_with_parent(signal.SIGKILL)  # the launcher died (even by SIGKILL): no orphan rank keeps a GPU
    rank = int(os.environ.get("RANK", "0"))
    rank_file = Path(args.rank_dir) / f"rank{rank}.json"
    state = new_state()
    on_sigterm_write({"state": state, "rank_file": rank_file})
    try:
        import torch.distributed as dist

        from trainer.config import load_config

        cfg = load_config(args.config, validate=False)  # `ppotune train` validated it and wrote this file
        run_trial(cfg, start_rank(cfg), rank, rank_file, state)
        dist.destroy_process_group()
        state["status"] = "ok"
        write_json_atomic(rank_file, state)
        leave_rank()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes data for the launcher
        fail_rank(exc, rank, rank_file, state)


if __name__ == "__main__":
    sys.exit(rank_main())
