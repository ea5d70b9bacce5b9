"""Host memory at start-up: every rank builds three full models (the old way) vs rank 0 loads and the
others build on the meta device and receive their shards (verl's way, what ``build_roles`` does now).

Each side is a real torchrun of 2 gloo ranks that builds actor, reference and critic of a widened tiny
preset, shards them with FSDP, and reports each rank's peak RSS (VmHWM) and what it held before the
models. The sides are interleaved run by run so machine load hits both alike; prints the median over
runs of each rank's growth and the ratio new/old.

    python benchmarks/bench_host_memory.py [--runs 3] [--hidden 512] [--layers 8]

The results: benchmarks/README.md, "Host memory at start-up".
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("every rank loads", "rank 0 loads, meta elsewhere")


def worker(side: str, hidden: int, layers: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.engine.metrics import rss_gb
    from trainer.engine.models import load_actor, load_critic, load_tokenizer
    from trainer.engine.parallel import ShardKnobs, shard_model
    from trainer.engine.roles import build_roles
    from trainer.launch.proc import leave_rank

    dist.init_process_group("gloo")
    torch.ones(1 << 16).sum()  # runtime threads up before the baseline
    cfg = load_config(
        ROOT / "configs" / "tiny_cpu.yaml",
        {
            "ppotune.tiny.hidden_size": hidden,
            "ppotune.tiny.intermediate_size": 4 * hidden,
            "ppotune.tiny.num_hidden_layers": layers,
            "ppotune.tiny.num_attention_heads": 8,
            "ppotune.tiny.num_key_value_heads": 4,
            "actor_rollout_ref.actor.strategy": os.environ.get("BENCH_STRATEGY", "fsdp"),
        },
    )
    tok = load_tokenizer("tiny")
    device = torch.device("cpu")
    before = rss_gb()
    if side == SIDES[0]:
        kw = dict(tiny=cfg.ppotune.tiny, max_positions=128, seed=1)
        models = [load_actor("tiny", tok, **kw), load_actor("tiny", tok, **kw), load_critic("tiny", tok, **kw)]
        knobs = ShardKnobs(strategy=cfg.actor_rollout_ref.actor.strategy, param_dtype="bf16")
        kept = [shard_model(m, knobs, device=device, name="m", notes=[]) for m in models]
    else:
        kept = build_roles(cfg, tok, device, dist.get_world_size(), [])
    after = rss_gb()
    row = torch.tensor([before, after], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([r.tolist() for r in rows]))
    del kept
    dist.barrier()
    dist.destroy_process_group()
    leave_rank()


def run(side: str, strategy: str, hidden: int, layers: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        cmd += ["--worker", side, "--hidden", str(hidden), "--layers", str(layers), "--out", str(out)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_STRATEGY": strategy}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
        if proc.returncode:
            sys.exit(f"{side}: torchrun failed\n{proc.stderr[-2000:]}")
        return [(after - before) * 1024 for before, after in json.loads(out.read_text())]  # GiB -> MiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--worker")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.hidden, args.layers, args.out)
    for strategy in ("fsdp", "fsdp2"):
        growth: dict[str, list[list[float]]] = {s: [] for s in SIDES}
        for r in range(args.runs):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                growth[side].append(run(side, strategy, args.hidden, args.layers))
        print(f"\n{strategy}: hidden {args.hidden}, {args.layers} layers, 2 gloo ranks, median of {args.runs} runs")
        print("  peak RSS growth while building actor + reference + critic (MiB):")
        med = {s: [statistics.median(run[k] for run in growth[s]) for k in range(2)] for s in SIDES}
        for side in SIDES:
            print(f"  {side:32s} rank 0 {med[side][0]:7.0f}   rank 1 {med[side][1]:7.0f}")
        print("  new / old:" + "".join(f"   rank {k} {med[SIDES[1]][k] / med[SIDES[0]][k]:.2f}" for k in range(2)))


if __name__ == "__main__":
    main()
