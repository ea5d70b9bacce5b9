"""Packed micro-batches: transformers' sdpa (dense T x T block mask) vs ``trainer.engine.attention`` (linear).

One forward+backward of a Qwen2 over a packed row of T tokens (many sequences of ``--seq-len``
tokens, position ids restarting at 0 for each), per path and token count, each in a fresh process
so one measurement's allocations cannot hide another's. The runs are interleaved (old, new, old,
new, ... over the sizes, ``--runs`` rounds) so machine noise hits both alike; the median is printed.

Peak memory is the growth of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs once the model is built) over its resident set at that moment: everything
the forward+backward allocated, the mask included. Time is the median of ``--iters`` timed
forward+backward passes after that first one (the warm-up).

The model is attention-heavy on purpose (hidden 64, 2 layers, small vocab), so the quadratic
term of the old path shows at a few thousand tokens. The results: benchmarks/README.md, "Packed attention".

    python benchmarks/bench_attention.py [--tokens 2048 4096 8192 16384] [--runs 1] [--iters 2]
    python benchmarks/bench_attention.py worker --path new --tokens 4096   # one measurement, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PATHS = {"old": "sdpa", "new": None}  # None: trainer.engine.attention.PACKED_ATTENTION (imported in the worker)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(args: argparse.Namespace) -> dict:
    """One measurement in this (fresh) process; the caller prints nothing else to stdout."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.engine.attention import PACKED_ATTENTION, packed_attention_kwargs

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=2 * args.hidden,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        use_cache=False,
    )
    cfg._attn_implementation = PATHS[args.path] or PACKED_ATTENTION
    model = Qwen2ForCausalLM(cfg).float()
    n = args.tokens // args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, n * args.seq_len))
    pos = torch.arange(args.seq_len).repeat(n).unsqueeze(0)

    def step() -> float:
        t0 = time.perf_counter()
        # the old path is the trainer's call before this module: ids and position ids only
        kw = packed_attention_kwargs(pos) if args.path == "new" else {}
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kw).logits
        logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    base_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    step()
    peak_mb = (_status_kb("VmHWM") - base_kb) / 1024
    time_s = statistics.median(step() for _ in range(args.iters)) if args.iters else None
    return {"path": args.path, "tokens": n * args.seq_len, "peak_mb": peak_mb, "time_s": time_s}


def measure(path: str, tokens: int, *, seq_len: int = 512, iters: int = 2, extra: tuple[str, ...] = ()) -> dict:
    """Run one worker in a fresh interpreter and return its JSON result."""
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "worker",
            "--path",
            path,
            "--tokens",
            str(tokens),
            "--seq-len",
            str(seq_len),
            "--iters",
            str(iters),
            *extra,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    ap.add_argument("--iters", type=int, default=2, help="timed forward+backward passes after the first")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        ap = argparse.ArgumentParser()
        ap.add_argument("worker")
        ap.add_argument("--path", choices=sorted(PATHS), required=True)
        ap.add_argument("--tokens", type=int, required=True)
        _add_model_args(ap)
        print(json.dumps(worker(ap.parse_args())))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--runs", type=int, default=1, help="interleaved rounds; the median is reported")
    _add_model_args(ap)
    args = ap.parse_args()
    extra = (
        *("--hidden", str(args.hidden), "--layers", str(args.layers)),
        *("--heads", str(args.heads), "--kv-heads", str(args.kv_heads)),
    )
    results: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.runs):
        for tokens in args.tokens:
            for path in PATHS:
                r = measure(path, tokens, seq_len=args.seq_len, iters=args.iters, extra=extra)
                results.setdefault((path, tokens), []).append(r)
                print(f"  {path} {tokens:>6} tokens: {r['peak_mb']:8.1f} MB  {r['time_s']:7.3f} s", flush=True)

    def med(path: str, tokens: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(path, tokens)])

    first = args.tokens[0]
    print()
    print(f"forward+backward of one packed row, sequences of {args.seq_len} tokens, median of {args.runs} run(s)")
    print(
        f"{'tokens':>7} | {'old MB':>8} {'new MB':>8} {'old/new':>7} | {'old s':>7} {'new s':>7} {'old/new':>7} | "
        f"{'old MB / at ' + str(first):>15} {'new MB / at ' + str(first):>15}"
    )
    for tokens in args.tokens:
        om, nm = med("old", tokens, "peak_mb"), med("new", tokens, "peak_mb")
        ot, nt = med("old", tokens, "time_s"), med("new", tokens, "time_s")
        print(
            f"{tokens:>7} | {om:8.1f} {nm:8.1f} {om / nm:7.2f} | {ot:7.3f} {nt:7.3f} {ot / nt:7.2f} | "
            f"{om / med('old', first, 'peak_mb'):15.2f} {nm / med('new', first, 'peak_mb'):15.2f}"
        )


if __name__ == "__main__":
    main()
