"""How well does ``tuner.memory_model`` predict a recorded grid's memory, and what would it save a search?

Reads the data file of ``benchmarks/record_grid.py`` (one JSON line per recorded trial of
``benchmarks/data/grid_space.yaml`` on ``benchmarks/data/grid_base.yaml``: 1 CPU process, a real cap of
``CAP_GB``; each line with ``by_phase_gb``, ``model_shape`` and ``lengths``). No trial is run.

1. Prediction error on held-out configs: for each ``k`` of ``--k`` and each of ``--seeds`` seeds, the model
   is calibrated on ``k`` configs drawn at random (one recorded repeat each) and predicts every recorded
   ``ok`` trial of the other configs. Printed: the relative error ``|pred - meas| / meas`` of the peak (the
   memory objective) and of the per-phase peaks, median and max (medians over the seeds, and the worst
   seed), against what the model states (its leave-one-out error) and the share of held-out trials beyond
   the gate's error (mean over the seeds); and the same for a constant predictor (the calibration trials'
   median peak).
2. Trial-seconds saved: a search that walks the grid in a random order (one recorded repeat per config)
   and, once the model states an error (``MIN_LOO_SAMPLES`` measured trials), does not launch a config
   predicted over the cap by more than that error (``MemoryModel.over_limit``); the model is recalibrated
   on the ``ok`` trials measured so far. Printed: the grid's trial-seconds, the seconds not spent, the recorded OOMs
   skipped (out of all), the ``ok`` configs skipped by mistake and whether the fastest feasible config was
   among them.

    python benchmarks/bench_memory_model.py [--data benchmarks/data/grid_tiny_cpu.jsonl] [--seeds 20]
                                            [--k 5 8 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import record_grid as rg  # noqa: E402

from trainer.config import flatten  # noqa: E402
from trainer.contracts import PHASES, Status  # noqa: E402
from tuner.memory_model import MIN_LOO_SAMPLES, MemoryModel, Sample, sample_from_attrs  # noqa: E402
from tuner.space import base_flat_config, load_space  # noqa: E402

NEEDED = ("by_phase_gb", "model_shape", "lengths")
_RECALIBRATE_EVERY = 8  # past 12 measured trials, recalibrate on every 8th (leave-one-out costs n fits)


@dataclass(frozen=True)
class Line:
    """One recorded trial of the grid."""

    config: tuple  # the config's identity in the space
    flat: dict  # the flat config it ran
    status: Status
    seconds: float
    throughput: Optional[float]
    sample: Optional[Sample]  # an ok trial with per-phase peaks


def load(data: Path) -> dict[tuple, list[Line]]:
    """identity -> its recorded trials. An inferred OOM (never launched) costs the seconds of its OOM."""
    space = load_space(rg.SPACE)
    base = flatten(base_flat_config(str(rg.BASE), nproc=rg.NPROC)[0])
    rows = [json.loads(x) for x in data.read_text().splitlines() if x.strip()]
    lacking = [k for k in NEEDED if not any(r.get(k) for r in rows if r["status"] == "ok")]
    if lacking:
        raise SystemExit(
            f"bench_memory_model: {data} has no {', '.join(lacking)} on its ok lines: re-record it with "
            "benchmarks/record_grid.py (the memory model is calibrated on per-phase peaks)"
        )
    table: dict[tuple, list[Line]] = {}
    for i, r in enumerate(rows):
        status = Status(r["status"])
        attrs = {
            "status": r["status"],
            "overrides": r.get("overrides") or {},
            "memory": {"by_phase_gb": r.get("by_phase_gb")},
            "memory_source": "rss_above_start",  # the CPU objective record_grid's trials measured
            "model_shape": r.get("model_shape"),
            "lengths": r.get("lengths"),
            "peak_memory_gb": r.get("peak_memory_gb"),
        }
        line = Line(
            config=space.identity({**base, **(r.get("overrides") or {})}),
            flat={**base, **(r.get("overrides") or {})},
            status=Status.OOM if status == Status.INFERRED_OOM else status,
            seconds=float(r.get("duration_s") or 0.0),
            throughput=r.get("throughput"),
            sample=sample_from_attrs(attrs, base, number=i),
        )
        table.setdefault(line.config, []).append(line)
    return table


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


# --------------------------------------------------------------------------- 1. prediction error
def prediction_error(table: dict, k: int, seed: int) -> dict:
    rng = random.Random(seed)
    measured = {c: [x for x in lines if x.sample] for c, lines in table.items()}
    measured = {c: xs for c, xs in measured.items() if xs}
    chosen = rng.sample(sorted(measured), k)
    model = MemoryModel.calibrate([rng.choice(measured[c]).sample for c in chosen])
    constant = statistics.median(rng.choice(measured[c]).sample.peak_gb for c in chosen)
    peak, phase, const = [], [], []
    for c, xs in measured.items():
        if c in chosen:
            continue
        for x in xs:
            pred = model.predict(x.sample.config)
            peak.append(_rel(pred.peak_gb, x.sample.peak_gb))
            phase += [_rel(pred.by_phase_gb[p], v) for p, v in x.sample.by_phase_gb.items() if v > 0]
            const.append(_rel(constant, x.sample.peak_gb))
    gate = model.gate_error
    return {
        "peak_median": statistics.median(peak),
        "peak_max": max(peak),
        "phase_median": statistics.median(phase),
        "phase_max": max(phase),
        "stated_median": model.error["peak"]["median"] if model.error else None,
        "stated_max": model.error["peak"]["max"] if model.error else None,
        "beyond_gate": sum(e > gate for e in peak) / len(peak) if gate is not None else None,
        "constant_median": statistics.median(const),
        "constant_max": max(const),
    }


def _print_errors(rows: list[dict], k: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows if r[key] is not None)  # noqa: E731
    worst = lambda key: max(r[key] for r in rows if r[key] is not None)  # noqa: E731
    out = {key: med(key) for key in rows[0]} | {"peak_max_worst_seed": worst("peak_max")}
    # how often the gate's error is exceeded: the mean over seeds (a median hides the unlucky calibrations)
    out["beyond_gate"] = statistics.mean(r["beyond_gate"] for r in rows if r["beyond_gate"] is not None)
    print(
        f"  k={k:2d}: peak error median {100 * out['peak_median']:4.1f}%  max {100 * out['peak_max']:4.1f}% "
        f"(worst seed {100 * out['peak_max_worst_seed']:4.1f}%) | per phase median {100 * out['phase_median']:4.1f}% "
        f"max {100 * out['phase_max']:4.1f}% | stated (leave-one-out) median {100 * out['stated_median']:4.1f}% "
        f"max {100 * out['stated_max']:4.1f}%, held-out beyond the gate's error {100 * out['beyond_gate']:4.1f}% | "
        f"constant predictor median {100 * out['constant_median']:4.1f}% max {100 * out['constant_max']:4.1f}%",
        flush=True,
    )
    return out


# --------------------------------------------------------------------------- 2. trial-seconds saved
def walk(table: dict, seed: int, cap_gb: float) -> dict:
    rng = random.Random(seed)
    order = list(table)
    rng.shuffle(order)
    outcome = {c: rng.choice(table[c]) for c in order}
    feasible = {c: x.throughput for c, x in outcome.items() if x.status == Status.OK and x.throughput}
    best = max(feasible, key=feasible.get) if feasible else None
    samples: list[Sample] = []
    model: Optional[MemoryModel] = None
    got = {"grid_s": 0.0, "oom_s": 0.0, "spent_s": 0.0, "saved_s": 0.0, "ooms": 0, "ooms_skipped": 0, "ok_skipped": 0}
    got["lost_best"] = False
    for c in order:
        x = outcome[c]
        got["grid_s"] += x.seconds
        got["ooms"] += x.status == Status.OOM
        got["oom_s"] += x.seconds if x.status == Status.OOM else 0.0  # what any OOM predictor could save at most
        if model is not None and model.over_limit(model.predict(x.flat).peak_gb, cap_gb):
            got["saved_s"] += x.seconds
            got["ooms_skipped"] += x.status == Status.OOM
            got["ok_skipped"] += x.status == Status.OK
            got["lost_best"] |= c == best
            continue
        got["spent_s"] += x.seconds
        if x.sample is not None:
            samples.append(x.sample)
            n = len(samples)
            if n >= MIN_LOO_SAMPLES and (n <= 12 or n % _RECALIBRATE_EVERY == 0):
                model = MemoryModel.calibrate(samples)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(rg.DATA))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--k", type=int, nargs="+", default=[5, 8, 16])
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    t0 = time.monotonic()
    table = load(Path(args.data))
    lines = [x for xs in table.values() for x in xs]
    print(
        f"bench_memory_model: {args.data}: {len(table)} configs, {len(lines)} lines "
        f"({sum(x.sample is not None for x in lines)} ok with per-phase peaks, "
        f"{sum(x.status == Status.OOM for x in lines)} OOM), cap {rg.CAP_GB} GB, {args.seeds} seeds",
        flush=True,
    )
    out: dict = {"data": args.data, "seeds": args.seeds, "errors": {}, "walk": {}}
    print("1. prediction error on held-out configs (calibrated on k random configs)")
    for k in args.k:
        rows = [prediction_error(table, k, seed) for seed in range(args.seeds)]
        out["errors"][k] = _print_errors(rows, k)
    everything = MemoryModel.calibrate(
        [
            random.Random(0).choice([x.sample for x in xs if x.sample])
            for xs in table.values()
            if any(x.sample for x in xs)
        ]
    )
    e = everything.error
    print(
        f"   calibrated on every config (one repeat each): leave-one-out peak median {100 * e['peak']['median']:.1f}% "
        f"max {100 * e['peak']['max']:.1f}%; per phase (median / max): "
        + ", ".join(f"{p} {100 * e['by_phase'][p]['median']:.0f}/{100 * e['by_phase'][p]['max']:.0f}%" for p in PHASES),
        flush=True,
    )
    out["stated_all"] = e
    print(f"2. trial-seconds saved by not launching configs predicted over the cap ({rg.CAP_GB} GB)")
    runs = [walk(table, seed, rg.CAP_GB) for seed in range(args.seeds)]
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    out["walk"] = {key: med(key) for key in runs[0] if key != "lost_best"}
    out["walk"]["lost_best_share"] = sum(r["lost_best"] for r in runs) / len(runs)
    w = out["walk"]
    print(
        f"   medians over seeds: grid {w['grid_s']:.0f} trial-s (its OOMs {w['oom_s']:.0f} s), saved "
        f"{w['saved_s']:.0f} s ({100 * w['saved_s'] / w['grid_s']:.1f}%), OOMs skipped {w['ooms_skipped']:.0f} of "
        f"{w['ooms']:.0f}, "
        f"ok configs skipped by mistake {w['ok_skipped']:.0f}; the fastest feasible config skipped in "
        f"{100 * w['lost_best_share']:.0f}% of the seeds",
        flush=True,
    )
    print(f"bench_memory_model: {time.monotonic() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
