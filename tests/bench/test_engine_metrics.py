"""The engines' speculation figures parsed from text in each engine's own format (runtime/bench/engine_metrics.py).

The texts below are what the engines print: vLLM's counters through prometheus_client (text format 0.0.4: the
`_total` sample, its `_created` twin, labels in declaration order model_name, engine[, position]; two engines of a
data-parallel server), llama.cpp b11434's hand-written exposition (tools/server/server-task.cpp: no labels but
`position`, values printed by a C++ stream), SGLang's gauges (python/sglang/srt/metrics/collector.py) and its
/get_server_info JSON.
"""

from __future__ import annotations

import pytest

from dspark_cli.runtime.bench.engine_metrics import (
    SpecCounters,
    llamacpp_draft_counts,
    parse_prometheus,
    sglang_avg_accept_length,
    sglang_gauges,
    spec_counters,
)


def vllm_text(drafts, draft_tokens, accepted, per_pos, engines=("0",)) -> str:
    """vLLM's spec-decode counters as prometheus_client exposes them, one series per engine (the values split)."""
    def block(name, doc, values_by_engine, extra=None):
        lines = [f"# HELP vllm:{name}_total {doc}", f"# TYPE vllm:{name}_total counter"]
        for engine, value in values_by_engine:
            labels = f'model_name="Qwen/Qwen3-8B",engine="{engine}"' + (f',{extra}' if extra else "")
            lines.append(f"vllm:{name}_total{{{labels}}} {float(value)!r}")
        lines += [f"# HELP vllm:{name}_created {doc}", f"# TYPE vllm:{name}_created gauge"]
        lines += [f'vllm:{name}_created{{model_name="Qwen/Qwen3-8B",engine="{e}"}} 1.7646e+09' for e, _ in
                  values_by_engine]
        return lines

    n = len(engines)
    split = lambda v: [(e, v / n) for e in engines]  # noqa: E731
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge",
             'vllm:num_requests_running{model_name="Qwen/Qwen3-8B",engine="0"} 3.0']
    lines += block("spec_decode_num_drafts", "Number of spec decoding drafts.", split(drafts))
    lines += block("spec_decode_num_draft_tokens", "Number of draft tokens.", split(draft_tokens))
    lines += block("spec_decode_num_accepted_tokens", "Number of accepted tokens.", split(accepted))
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    for pos, value in enumerate(per_pos):
        for engine, share in split(value):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="Qwen/Qwen3-8B",'
                         f'engine="{engine}",position="{pos}"}} {share!r}')
    return "\n".join(lines) + "\n"


LLAMACPP_METRICS = """# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 70
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 128
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 342
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 69
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 53
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 261.322
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 26
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 21
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 10
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 7
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="4"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="5"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="6"} 1
"""

SGLANG_METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 2.9
sglang:spec_accept_length{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="1"} 3.1
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding (`accepted tokens / total draft \
tokens` in batch).
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.27
"""


def test_vllm_counters_one_engine():
    counters = spec_counters(vllm_text(10, 70, 30, [9, 8, 6, 4, 2, 1, 0]), "vllm")
    assert counters == SpecCounters(10.0, 70.0, 30.0, (9.0, 8.0, 6.0, 4.0, 2.0, 1.0, 0.0))
    assert counters.acceptance == pytest.approx(30 / 70)
    assert counters.accept_length == pytest.approx(1 + 30 / 10)
    assert counters.position_rates == pytest.approx([0.9, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0])


def test_vllm_counters_summed_over_engines_and_differenced():
    before = spec_counters(vllm_text(10, 70, 30, [9, 8, 6, 4, 2, 1, 0], engines=("0", "1")), "vllm")
    after = spec_counters(vllm_text(30, 210, 100, [28, 25, 20, 14, 8, 4, 1], engines=("0", "1")), "vllm")
    assert before == SpecCounters(10.0, 70.0, 30.0, (9.0, 8.0, 6.0, 4.0, 2.0, 1.0, 0.0))
    delta = after.since(before)
    assert delta == SpecCounters(20.0, 140.0, 70.0, (19.0, 17.0, 14.0, 10.0, 6.0, 3.0, 1.0))
    assert delta.acceptance == pytest.approx(0.5)
    assert sum(delta.per_position) == delta.accepted  # every accepted token sits at one position


def test_vllm_created_samples_and_other_prefixes_ignored():
    text = vllm_text(4, 28, 12, [4, 4, 4])
    assert spec_counters(text, "llamacpp") is None
    assert spec_counters(text.replace("_total{", "_created{"), "vllm") is None  # only _created left: no totals


def test_llamacpp_metrics():
    counters = spec_counters(LLAMACPP_METRICS, "llamacpp")
    assert counters == SpecCounters(53.0, 342.0, 69.0, (26.0, 21.0, 10.0, 7.0, 2.0, 2.0, 1.0))
    assert counters.accept_length == pytest.approx(1 + 69 / 53)


def test_counter_reset_reads_from_zero():
    before = SpecCounters(50.0, 350.0, 100.0, (40.0, 30.0, 30.0))
    after = SpecCounters(5.0, 35.0, 10.0, (4.0, 3.0, 3.0))
    assert after.since(before) == after


def test_sglang_gauges_and_server_info():
    gauges = sglang_gauges(SGLANG_METRICS)
    assert gauges.accept_length_gauge == pytest.approx(3.0)  # mean of the two tp ranks' series
    assert gauges.accept_rate_gauge == pytest.approx(0.27)
    info = {"internal_states": [{"last_gen_throughput": 120.5, "avg_spec_accept_length": 2.5},
                                {"last_gen_throughput": 118.0, "avg_spec_accept_length": 3.5}], "version": "0.5"}
    assert sglang_avg_accept_length(info) == pytest.approx(3.0)
    assert sglang_avg_accept_length({"decode": [info]}) == pytest.approx(3.0)
    assert sglang_avg_accept_length({"internal_states": [{"last_gen_throughput": 1.0}]}) is None
    assert spec_counters(SGLANG_METRICS, "vllm") is None


def test_parse_prometheus_labels_escapes_and_junk():
    samples = parse_prometheus('a{x="1",y="q\\"uote"} 2.5 1700000000\n# c\nnot a sample\nb NaN\nc 1e+06\n')
    assert [(s.name, s.labels, s.value) for s in samples[:1]] == [("a", {"x": "1", "y": 'q\\"uote'}, 2.5)]
    assert samples[2].value == 1e6 and len(samples) == 3


def test_llamacpp_timings():
    assert llamacpp_draft_counts({"predicted_n": 32, "draft_n": 76, "draft_n_accepted": 19}) == (76, 19)
    assert llamacpp_draft_counts({"predicted_n": 32}) == (0, 0)  # the slot drafted nothing: the keys are absent
    assert llamacpp_draft_counts(None) == (0, 0)
