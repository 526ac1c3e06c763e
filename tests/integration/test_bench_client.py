"""The benchmark's HTTP client (bench/streams.py) against a real gateway: streams counted by tokens,
its own CPU time recorded, and the summary's spread over rounds.

Runs in the pytest process against the module's two-model CPU gateway: the same client that
bench/bench_engines.py points at our gateway and at any peer server (--peer).
"""

from __future__ import annotations

from bench.streams import Round, Stream, http_round, summarize
from tests.harness import GatewayProcess


def test_the_async_client_counts_tokens_and_its_own_cpu(two_model_gateway: GatewayProcess) -> None:
    prompts = [f"Stream {i}: hello" for i in range(4)]
    done = http_round(two_model_gateway.url, "demo-small", prompts, 8, 1)
    assert len(done.streams) == 4 and all(s.tokens == 8 for s in done.streams)
    assert done.client_cpu_s > 0 and done.seconds > 0
    summary = summarize([done, http_round(two_model_gateway.url, "demo-small", prompts, 8, 1)])
    assert summary["tokens"] == 64 and summary["rounds"] == 2
    assert summary["tok_s_total_min"] <= summary["tok_s_total"] <= summary["tok_s_total_max"]
    assert summary["client_cpu_us_per_token"] > 0


def test_the_summary_reports_the_median_and_the_spread_of_rounds() -> None:
    def round_of(tokens_per_s: float) -> Round:
        stream = Stream(0.0, [(i + 1) / tokens_per_s for i in range(10)])
        return Round([stream])

    summary = summarize([round_of(100.0), round_of(300.0), round_of(200.0)])
    assert (summary["tok_s_total_min"], summary["tok_s_total"], summary["tok_s_total_max"]) == (
        100.0, 200.0, 300.0)  # fmt: skip
