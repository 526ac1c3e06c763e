"""Time to first token as the gateway saw it, read from its access log for the benchmark's rounds.

Imported by bench/bench_engines.py (the bench process, after its gateway stopped). The client
(bench/streams.py) names each request `bench-MODEL-Ns-ROUND-INDEX` in X-Request-ID; the gateway's
access line for it carries `ttft=...ms`, timed from the request's routing to the first output the
worker sent. Set beside the client's own time to first token and the library's, it splits what the
gateway adds into the HTTP side (client, connection, parsing, the first chunk's write) and the
worker side (the hop to the worker, prompt preparation, the engine's first step, the hop back).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

_ACCESS_TTFT = re.compile(r"ttft=([0-9.]+)ms .*request_id=(bench-[A-Za-z0-9._-]+)-(\d+)(?=[\s\]])")


def ttft_by_round(log_text: str) -> dict[str, list[float]]:
    """Each round id's requests' gateway-side times to first token, in ms."""
    rounds: dict[str, list[float]] = {}
    for match in _ACCESS_TTFT.finditer(log_text):
        rounds.setdefault(match.group(2), []).append(float(match.group(1)))
    return rounds


def add_gateway_ttft(rows: list[dict[str, Any]], *log_paths: Path) -> None:
    """Adds `gateway_ttft_ms_p50` to every row whose rounds' requests are in the logs (several
    gateway processes: each request is in the log of the one that served it)."""
    texts = []
    for log_path in log_paths:
        try:
            texts.append(log_path.read_text(errors="replace"))
        except OSError:
            continue
    by_round = ttft_by_round("\n".join(texts))
    for row in rows:
        values = [ms for round_id in row.get("round_ids", ()) for ms in by_round.get(round_id, ())]
        if values:
            row["gateway_ttft_ms_p50"] = round(statistics.median(values), 2)
