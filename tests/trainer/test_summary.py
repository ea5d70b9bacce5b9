"""When a trial has measured enough: the interval, the stop rule, the summary (pure, no torch)."""

import math
import statistics

import pytest

from trainer.summary import first_step_outlier, interval, measuring_done, percentiles, summarize_steps


def test_interval_is_the_t_half_width_around_the_median():
    xs = [10.0, 12.0, 11.0, 13.0]
    lo, hi = interval(xs)
    half = 2.353 * statistics.stdev(xs) / math.sqrt(4)  # t(0.95, 3) = 2.353
    assert statistics.median(xs) == pytest.approx((lo + hi) / 2)
    assert (hi - lo) / 2 == pytest.approx(half)
    assert interval([5.0]) is None
    assert interval([5.0, 5.0]) == (5.0, 5.0)


def test_interval_narrows_with_more_steps_of_the_same_spread():
    few, many = [9.0, 11.0] * 2, [9.0, 11.0] * 10
    assert interval(many)[1] - interval(many)[0] < (interval(few)[1] - interval(few)[0]) / 3


def test_percentiles_nearest_rank():
    got = percentiles(list(range(1, 11)))
    assert got == {"p10": 1.0, "p50": 5.0, "p90": 9.0, "max": 10.0}
    assert percentiles([]) == {}


def test_tight_stops_only_after_the_minimum_and_within_precision():
    steady = [100.0, 101.0, 99.0]
    assert measuring_done(steady[:2], peak_memory_gb=1.0, precision=0.05) is None  # below 3 measured steps
    assert measuring_done(steady, peak_memory_gb=1.0, precision=0.05).startswith("tight")
    noisy = [100.0, 140.0, 70.0]
    assert measuring_done(noisy, peak_memory_gb=1.0, precision=0.05) is None
    assert measuring_done(steady, peak_memory_gb=1.0, precision=None) is None  # off: every step runs


def test_pruned_only_by_a_point_better_for_sure_at_no_more_memory():
    xs = [100.0, 104.0, 96.0]  # upper bound ~111.7
    hi = interval(xs)[1]
    assert measuring_done(xs, peak_memory_gb=2.0, precision=None, front=[[4, hi + 1, 1.5]]).startswith(
        "pruned: trial 4"
    )
    # better but needs more memory: this trial may be on the low-memory end of the front
    assert measuring_done(xs, peak_memory_gb=2.0, precision=None, front=[[4, hi + 1, 2.5]]) is None
    # within the noise: not pruned
    assert measuring_done(xs, peak_memory_gb=2.0, precision=None, front=[[4, hi - 1, 1.0]]) is None


def _row(step, thr, warmup=False, rss=1.5, above=0.4):
    return {
        "step": step,
        "warmup": warmup,
        "timing_s/step": 1.0,
        "perf/throughput": thr,
        "perf/peak_rss_gb": rss,
        "perf/peak_rss_above_start_gb": above,
    }


def test_summary_cpu_memory_is_above_the_post_start_level_with_the_absolute_beside():
    rows = [_row(1, 50.0, warmup=True, above=0.6), _row(2, 100.0), _row(3, 110.0), _row(4, 90.0)]
    s = summarize_steps(rows, device_type="cpu", lengths={"prompt": [3, 5, 9], "response": []})
    assert s["peak_memory_gb"] == 0.6 and s["memory_source"] == "rss_above_start"  # warm-up counts for peaks
    assert s["peak_rss_gb"] == 1.5
    assert s["throughput"] == 100.0 and s["num_measured_steps"] == 3
    lo, hi = s["throughput_ci"]
    assert lo < 100.0 < hi
    assert s["lengths"] == {"prompt": {"p10": 3.0, "p50": 5.0, "p90": 9.0, "max": 9.0}}


def test_summary_cuda_memory_is_the_allocators_reserved_peak_over_every_step():
    """On CUDA the trial's own memory figure is torch's reserved peak (what the caching allocator holds of the device,
    the figure ``--memory-limit-gb``'s fraction bounds), never the host's RSS, the warm-up step included."""
    rows = [{**_row(1, 50.0, warmup=True), "perf/max_memory_reserved_gb": 7.5}]
    rows += [{**_row(i, 100.0), "perf/max_memory_reserved_gb": 6.0} for i in (2, 3)]
    s = summarize_steps(rows, device_type="cuda", lengths=None)
    assert s["peak_memory_gb"] == 7.5 and s["memory_source"] == "torch_cuda"


def test_a_later_warm_trials_first_step_is_a_warm_up_only_when_slower_than_the_next():
    assert first_step_outlier([5.0, 1.0]) is None  # two others needed
    assert first_step_outlier([1.4, 1.0, 1.0]) is False  # within CPU noise: measured
    assert first_step_outlier([1.6, 1.0, 1.1, 0.9]) is True  # lazy initialisation: the warm-up it skipped
    assert first_step_outlier([1.6, 1.0, 1.2], factor=2.0) is False
