"""bench_stall's engine-side ITL: vLLM's histogram read from /metrics, the window's share of
it, and its percentiles."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_stall import (
    ITL_BUCKETS_S,
    _per_bucket,
    aa_controls,
    base_config,
    engine_step_ratios,
    hist_percentile,
    itl_aims,
    itl_bucket_args,
    itl_histogram,
    round_ratios,
    warms_in_place,
)


def _metrics(cumulative: dict[float, float], engine: str) -> str:
    """/metrics lines as prometheus_client writes a histogram (cumulative, +Inf last)."""
    lines = ["# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency",
             "# TYPE vllm:inter_token_latency_seconds histogram"]
    running = 0.0
    for bound in ITL_BUCKETS_S:
        running = cumulative.get(bound, running)
        lines.append(f'vllm:inter_token_latency_seconds_bucket{{engine="{engine}",'
                     f'le="{bound!r}",model_name="m"}} {running}')
    lines.append(f'vllm:inter_token_latency_seconds_bucket{{engine="{engine}",le="+Inf",'
                 f'model_name="m"}} {cumulative.get(math.inf, running)}')
    lines.append(f'vllm:inter_token_latency_seconds_count{{engine="{engine}"}} {running}')
    return "\n".join(lines)


def test_the_histogram_is_read_and_summed_over_label_sets() -> None:
    text = _metrics({0.005: 10.0, 0.01: 30.0}, "0") + "\n" + _metrics({0.005: 1.0}, "1")
    counts = itl_histogram(text)
    assert len(counts) == len(ITL_BUCKETS_S) + 1
    assert counts[ITL_BUCKETS_S.index(0.005)] == 11.0
    assert counts[ITL_BUCKETS_S.index(0.01)] == 31.0
    assert counts[-1] == 31.0


def test_a_server_without_the_fine_buckets_is_refused() -> None:
    text = 'vllm:inter_token_latency_seconds_bucket{le="0.3",model_name="m"} 3.0'
    with pytest.raises(ValueError, match="itl_bucket_args"):
        itl_histogram(text)


def test_the_window_gets_what_was_added_between_two_scrapes() -> None:
    start = itl_histogram(_metrics({0.005: 10.0, 0.01: 30.0}, "0"))
    end = itl_histogram(_metrics({0.005: 14.0, 0.01: 40.0, 0.05: 41.0}, "0"))
    window = _per_bucket(start, end)
    assert window[ITL_BUCKETS_S.index(0.005)] == 4.0  # 4 new ITLs of at most 5 ms
    assert window[ITL_BUCKETS_S.index(0.01)] == 6.0  # 6 new ones within (9.5, 10] ms
    assert window[ITL_BUCKETS_S.index(0.05)] == 1.0
    assert sum(window) == 11.0


def test_percentiles_interpolate_within_a_bucket() -> None:
    counts = [0.0] * (len(ITL_BUCKETS_S) + 1)
    counts[ITL_BUCKETS_S.index(0.005)] = 98.0  # (4.5, 5] ms
    counts[ITL_BUCKETS_S.index(0.05)] = 2.0  # (49, 50] ms
    assert hist_percentile(counts, 50) == pytest.approx(0.0045 + 0.0005 * 50 / 98)
    assert hist_percentile(counts, 99) == pytest.approx(0.049 + 0.001 * 0.5)
    assert math.isnan(hist_percentile([0.0] * len(counts), 99))


def test_the_server_argument_names_the_same_buckets() -> None:
    flag, value = itl_bucket_args()
    assert flag == "--custom-histogram-buckets"
    assert f'"inter_token_latency": [{ITL_BUCKETS_S[0]}' in value


def test_round_ratios_pair_each_round_with_vllm_alone_s_same_round() -> None:
    none = {"itl_p99_ms_per_round": [2.0, 4.0, 8.0],
            "store_ttft_p50_ms_per_round": [50.0, 100.0, float("nan")],
            "restore_ttft_p50_ms_per_round": [300.0, 0.0, 200.0]}
    kvtier = {"itl_p99_ms_per_round": [3.0, 4.0, 4.0],
              "store_ttft_p50_ms_per_round": [25.0, 300.0, 10.0],
              "restore_ttft_p50_ms_per_round": [30.0, 10.0, 100.0]}
    rr = round_ratios({"none": none, "kvtier": kvtier}, "kvtier")
    assert rr["itl_p99_vs_no_connector"] == {"per_round": [1.5, 1.0, 0.5], "median": 1.0,
                                             "min": 0.5, "max": 1.5}
    # a round where vLLM alone has no figure (nan) or a zero one is left out, not divided by
    assert rr["store_ttft_p50_vs_no_connector"]["per_round"] == [0.5, 3.0]
    assert rr["restore_ttft_p50_vs_no_connector"]["per_round"] == [0.1, 0.5]
    assert round_ratios({"kvtier": kvtier}, "kvtier") == {}


def _config(itl_p99: list[float], steps: dict[str, dict[str, float]] | None = None
            ) -> dict[str, object]:
    return {"itl_p99_ms": max(itl_p99), "itl_p99_ms_per_round": itl_p99,
            "store_ttft_p50_ms_per_round": [1.0] * len(itl_p99),
            "restore_ttft_p50_ms_per_round": [1.0] * len(itl_p99), "errors": [],
            "truncated_rounds": 0, "hook_steps": {"engine_steps": steps} if steps else None}


def test_engine_steps_are_compared_kind_by_kind_and_any_kvtier_config_is_judged() -> None:
    summary = {
        "none": _config([4.0, 4.0, 4.0]),
        "native": _config([5.0, 5.0, 5.0], {"decode": {"p50": 2.0, "p99": 4.0, "steps": 900},
                                            "chunk": {"p50": 10.0, "p99": 20.0, "steps": 30}}),
        "kvtier-daemon": _config([4.0, 5.0, 6.0],
                                 {"decode": {"p50": 2.2, "p99": 3.0, "steps": 800},
                                  "mixed": {"p50": 5.0, "p99": 6.0, "steps": 4},
                                  "chunk": {"p50": 12.0, "p99": 20.0, "steps": 31}})}
    ratios = engine_step_ratios(summary, "kvtier-daemon")
    assert ratios == {  # a kind native never ran (mixed) has no ratio
        "decode": {"p50": pytest.approx(1.1), "p99": 0.75, "steps": 800, "native_steps": 900},
        "chunk": {"p50": 1.2, "p99": 1.0, "steps": 31, "native_steps": 30}}
    assert engine_step_ratios(summary, "kvtier") == {}
    aims = itl_aims(summary, "kvtier-daemon")
    assert aims["valid"]
    paired = aims["itl_p99_vs_native"].pop("paired")
    # runs recorded before per-round p50s have none to pair
    assert aims["itl_p99_vs_native"].pop("p50_paired") == {"rounds": 0, "geo_mean": None,
                                                           "ci95": [None, None]}
    assert aims["itl_p99_vs_native"] == {"pooled": 1.2, "median_of_rounds": 1.0, "bound": 1.0,
                                         "met": False}
    assert paired["rounds"] == 3  # per-round ratios 0.8, 1.0, 1.2
    assert paired["geo_mean"] == pytest.approx((0.8 * 1.0 * 1.2) ** (1 / 3))
    assert paired["ci95"][0] < 1.0 < paired["ci95"][1]
    assert aims["itl_p99_vs_no_connector"]["pooled"] == 1.5
    assert aims["itl_p99_vs_no_connector"]["met"] is False  # 1.5 > 1.2


def test_an_aa_control_is_read_against_the_config_it_repeats() -> None:
    summary = {"none": _config([4.0, 8.0, 4.0]), "none-again": _config([5.0, 8.0, 2.0]),
               "native": _config([4.0, 4.0, 4.0]), "native-again": _config([4.0, 4.4, 3.6]),
               "kvtier": _config([4.0, 4.0, 4.0])}
    summary["native"]["itl_p50_ms_per_round"] = [2.0, 2.0, 2.0]
    summary["native-again"]["itl_p50_ms_per_round"] = [2.2, 2.2, 2.2]
    controls = aa_controls(summary)
    assert set(controls) == {"none-again", "native-again"}
    assert controls["native-again"].pop("p50_paired")["geo_mean"] == pytest.approx(1.1)
    assert controls["none-again"].pop("p50_paired")["rounds"] == 0
    assert round_ratios(summary, "native-again", "native")["itl_p50_vs_no_connector"][
        "per_round"] == pytest.approx([1.1, 1.1, 1.1])
    assert controls["none-again"].pop("paired")["geo_mean"] == pytest.approx(
        (1.25 * 1.0 * 0.5) ** (1 / 3))
    assert controls["none-again"] == {"against": "none", "pooled": 1.0,
                                      "median_of_rounds": 1.0, "per_round": [1.25, 1.0, 0.5],
                                      "min": 0.5, "max": 1.25}
    assert controls["native-again"]["against"] == "native"
    assert controls["native-again"]["pooled"] == pytest.approx(1.1)
    assert controls["native-again"]["per_round"] == pytest.approx([1.0, 1.1, 0.9])
    assert aa_controls({"native-again": _config([1.0])}) == {}  # nothing it repeats
    assert base_config("native-again") == "native"
    assert base_config("kvtier-daemon") == "kvtier-daemon"


def test_only_the_redis_restoring_kvtier_configs_skip_the_warm_in_place() -> None:
    assert [c for c in ("none", "native", "kvtier", "kvtier-daemon", "kvtier-local",
                        "none-again", "native-again") if warms_in_place(c)] == [
        "none", "native", "kvtier-local", "none-again", "native-again"]
