"""Stream drivers for the GPU benchmarks: N concurrent greedy streams, raw in-process or over HTTP.

Imported by bench/bench_engines.py (a standalone benchmark process on a GPU host). Owns the two
ways to run one round of N streams and what each records: the arrival time of every token, so
time to first token, tokens per second and the gap between tokens are all counted by tokens.
Raw rounds drive the engine's own generator (exllamav2's or exllamav3's) directly, with the
library's own job and greedy sampler, and also time every generator step. HTTP rounds stream
/v1/completions over aiohttp, one kept-alive connection per stream: with `logprobs` each chunk says
how many tokens it carries; without, the count is checked instead (every chunk must be one token,
which the demo tokenizer makes true).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Stream:
    started: float
    token_times: list[float] = field(default_factory=list)  # one entry per token

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.started

    @property
    def tok_s(self) -> float:
        return self.tokens / (self.token_times[-1] - self.started)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass
class Round:
    streams: list[Stream]
    step_seconds: list[float] = field(default_factory=list)  # raw rounds: every generator step
    chunks: int = 0  # HTTP rounds: content chunks received, to check one token per chunk
    client_cpu_s: float = 0.0  # HTTP rounds: CPU time of the benchmark's own client process
    worker_cpu_s: float | None = None  # gateway rounds: CPU time of the worker process meanwhile
    gateway_cpu_s: float | None = None  # gateway rounds: CPU time of the gateway process meanwhile
    # gateway rounds: share of samples in which another busy thread ran on the engine thread's core
    engine_core_shared: float | None = None
    engine_cpu: tuple[int, float] | None = None  # the CPU the engine thread ran on most, and its share
    # what the threads of the process driving the engine did meanwhile (proc_cpu.thread_usage)
    threads: dict[str, Any] | None = None
    round_id: str | None = None  # HTTP rounds: the prefix of its requests' X-Request-ID
    host_steal_pct: float | None = None  # share of the host's CPU time taken by its hypervisor meanwhile
    neighbour_cpu_s: float | None = None  # rounds beside bench/neighbours.py: the CPU time they used
    gpu: dict[str, float] | None = None  # GPU 0's mean clocks, power and use meanwhile (bench/gpu_clocks.py)

    @property
    def seconds(self) -> float:
        """First request to last token."""
        return max(s.token_times[-1] for s in self.streams) - min(s.started for s in self.streams)

    @property
    def tok_s(self) -> float:
        """Every stream's tokens over the round's seconds."""
        return sum(s.tokens for s in self.streams) / self.seconds

    @property
    def ttft_p50(self) -> float:
        return percentile([s.ttft for s in self.streams], 0.5)


def raw_round(
    engine_name: str, engine: Any, prompts: list[list[int]], new_tokens: int, trace: Any = None
) -> Round:
    """One round of greedy jobs straight through the library's generator (our engine only built it)."""
    torch, generator = engine._torch, engine.generator
    streams = [Stream(0.0) for _ in prompts]
    if engine_name == "exllamav2":
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        def job(i: int, ids: Any) -> Any:
            return ExLlamaV2DynamicJob(input_ids=ids, max_new_tokens=new_tokens, identifier=i,
                                       gen_settings=ExLlamaV2Sampler.Settings.greedy())  # fmt: skip
    else:
        import exllamav3

        def job(i: int, ids: Any) -> Any:
            return exllamav3.Job(input_ids=ids, max_new_tokens=new_tokens, identifier=i,
                                 sampler=exllamav3.ArgmaxSampler())  # fmt: skip

    steps: list[float] = []
    ingested: dict[Any, int] = {}  # each job's prompt tokens prefilled, from the library's reports
    found: dict[Any, int] = {}  # each started job's prompt tokens found in the cache (traced rounds)
    if trace is not None:
        trace.count_prefill(lambda: sum(ingested.values()), lambda: sum(found.values()))
    jobs = []
    for i, prompt in enumerate(prompts):
        streams[i].started = time.perf_counter()
        jobs.append(job(i, torch.tensor([prompt], dtype=torch.long)))
        generator.enqueue(jobs[-1])
    while generator.num_remaining_jobs():
        if trace is not None:
            trace.before_step()
        started = time.perf_counter()
        results = generator.iterate()
        now = time.perf_counter()
        steps.append(now - started)
        emitted = []
        for result in results:
            if result["stage"] == "prefill":
                ingested[result["identifier"]] = int(result.get("curr_progress", 0))
            if result["stage"] == "streaming" and "token_ids" in result:
                count = int(result["token_ids"].shape[-1])
                streams[result["identifier"]].token_times += [now] * count
                emitted.append((result["identifier"], count, bool(result.get("eos"))))
                if trace is not None and result["identifier"] not in found:  # as our engine counts it
                    found[result["identifier"]] = engine._found_in_cache(jobs[result["identifier"]])
        if trace is not None:
            trace.after_step(emitted)
            trace.after_send()
    return Round(streams, steps)


def engine_round(
    engine: Any,
    prompts: list[list[int]],
    new_tokens: int,
    trace: Any = None,
    send: Callable[[list[Any]], None] | None = None,
    logprobs: int | None = None,
) -> Round:
    """One round through our engine's submit/step in this process (the worker's engine, no serve
    loop or HTTP): with raw and gateway rounds it splits the gateway's overhead in two. `send`, if
    given, takes each step's outputs after the step (bench/link_sink.py: a Step frame to a sink);
    `logprobs`, every job asks for that many alternatives per token."""
    from wire.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    streams = {f"e{i}": Stream(0.0) for i in range(len(prompts))}
    for (rid, stream), prompt in zip(streams.items(), prompts, strict=True):
        stream.started = time.perf_counter()
        engine.submit(rid, prompt, params)
    steps: list[float] = []
    if trace is not None:
        trace.count_prefill(engine.prefill_tokens, engine.cached_prompt_tokens)
    while engine.has_work():
        if trace is not None:
            trace.before_step()
        started = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append(now - started)
        for output in outputs:
            streams[output.rid].token_times += [now] * len(output.token_ids)
        if trace is not None:
            trace.after_step([(o.rid, len(o.token_ids), o.finish_reason is not None) for o in outputs])
        if send is not None and outputs:
            send(outputs)
        if trace is not None:
            trace.after_send()
    return Round(list(streams.values()), steps)


# Each HTTP round's number, in its requests' X-Request-ID (bench-MODEL-STREAMSs-ROUND-INDEX), so the
# gateway's access log lines (time to first token as the gateway saw it) can be matched to rounds.
_round_numbers = itertools.count()


def http_round(url: str, model: str, prompts: list[str], new_tokens: int, logprobs: int | None) -> Round:
    """One round of concurrent streamed completions from one asyncio client in this process (one
    kept-alive connection per stream, opened before the clock starts, as an SDK's pool holds them):
    the same client for our gateway and for any peer server. Its own CPU time is recorded, to show
    that the client is not what limits the figures."""
    round_id = f"bench-{model}-{len(prompts)}s-{next(_round_numbers)}"
    cpu_started = time.process_time()
    done = asyncio.run(_http_streams(url, model, prompts, new_tokens, logprobs, round_id))
    cpu_s = time.process_time() - cpu_started
    streams, chunks = [stream for stream, _ in done], sum(chunks for _, chunks in done)
    return Round(streams, chunks=chunks, client_cpu_s=cpu_s, round_id=round_id)


async def _http_streams(
    url: str, model: str, prompts: list[str], new_tokens: int, logprobs: int | None, round_id: str
) -> list[tuple[Stream, int]]:
    body: dict[str, Any] = {"model": model, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if logprobs is not None:
        body["logprobs"] = logprobs

    async def one(session: aiohttp.ClientSession, index: int, prompt: str) -> tuple[Stream, int]:
        stream, chunks, usage = Stream(time.perf_counter()), 0, None
        headers = {"X-Request-ID": f"{round_id}-{index}"}
        request = {**body, "prompt": prompt}
        async with session.post("/v1/completions", json=request, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                usage = event.get("usage") or usage
                for choice in event.get("choices", []):
                    counted = len((choice.get("logprobs") or {}).get("tokens") or [])
                    if logprobs is None and choice.get("text"):
                        counted = 1
                        chunks += 1
                    stream.token_times += [now] * counted
        if usage is None or usage["completion_tokens"] != new_tokens:
            raise RuntimeError(f"stream ended with usage {usage}, expected {new_tokens} tokens")
        return stream, chunks

    async def open_connection(session: aiohttp.ClientSession) -> None:
        # Any answer leaves the connection open in the pool; /v1/models is on every OpenAI server.
        async with session.get("/v1/models") as response:
            await response.read()

    # A client's connection setup is its own cost, not the server's: the raw path has none, and an
    # SDK keeps its connections alive between requests. So each stream's connection is opened (all
    # at once, so that there is one per stream) before the round's clock starts.
    connector = aiohttp.TCPConnector(limit=len(prompts), keepalive_timeout=600)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(open_connection(session) for _ in prompts))
        return await asyncio.gather(*(one(session, i, prompt) for i, prompt in enumerate(prompts)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def paired(rounds: list[Round], raw: list[Round]) -> dict[str, Any]:
    """Each round against the raw round of the same turn (rounds interleave, so the two ran seconds
    apart): the host's CPU speed drifts by up to 1.7x over a run, and a ratio of two medians taken
    from different minutes carries that drift, while a ratio within one turn mostly cancels it."""
    turn_ratios = [r.tok_s / base.tok_s for r, base in zip(rounds, raw, strict=True)]
    turn_added = [1000 * (r.ttft_p50 - base.ttft_p50) for r, base in zip(rounds, raw, strict=True)]
    ratios, added = sorted(turn_ratios), sorted(turn_added)
    # The median: with an even count of turns, the mean of the two middle ones (not the upper one,
    # which read every even-round run high in tok/s and in first-token time added).
    return {
        "paired_ratio": statistics.median(ratios),
        "paired_ratio_min": ratios[0],
        "paired_ratio_max": ratios[-1],
        "paired_ratio_ci95": median_interval(ratios),
        "paired_ttft_added_ms": statistics.median(added),
        "paired_ttft_added_ms_min": added[0],
        "paired_ttft_added_ms_max": added[-1],
        "paired_ttft_added_ms_ci95": median_interval(added),
        # Each turn's, in the order they ran: so runs can be pooled turn by turn afterwards.
        "paired_ratio_turns": [round(x, 4) for x in turn_ratios],
        "paired_ttft_added_ms_turns": [round(x, 2) for x in turn_added],
    }


def median_interval(values: list[float], level: float = 0.95) -> list[float] | None:
    """A distribution-free confidence interval for the median: the narrowest pair of order
    statistics x(k), x(n+1-k) that holds the true median with at least `level` probability
    (the count of values below it is Binomial(n, 1/2)). None for fewer than 6 values, which
    cannot reach 95 %: the spread is all such a run can say."""
    ordered, n = sorted(values), len(values)
    for k in range(n // 2, 0, -1):
        coverage = sum(math.comb(n, i) for i in range(k, n - k + 1)) / 2**n
        if coverage >= level:
            return [ordered[k - 1], ordered[n - k]]
    return None


def summarize(rounds: list[Round]) -> dict[str, Any]:
    """Per-round total rate (median over rounds) and per-stream, TTFT and gap percentiles over all."""
    streams = [s for r in rounds for s in r.streams]
    gaps = [g for s in streams for g in s.gaps]
    steps = [t for r in rounds for t in r.step_seconds]
    totals = [r.tok_s for r in rounds]
    steal = [r.host_steal_pct for r in rounds if r.host_steal_pct is not None]
    tokens = sum(s.tokens for s in streams)
    client_cpu = sum(r.client_cpu_s for r in rounds)
    mean_gap = sum(gaps) / len(gaps) if gaps else 0.0
    median_gap = percentile(gaps, 0.5)
    return {
        "tok_s_total": statistics.median(totals),
        # The spread over rounds: one run of one engine moved by up to 25% between rounds.
        "tok_s_total_min": min(totals),
        "tok_s_total_max": max(totals),
        "rounds": len(rounds),
        "tok_s_per_stream": percentile([s.tok_s for s in streams], 0.5),
        "ttft_ms_p50": 1000 * percentile([s.ttft for s in streams], 0.5),
        "ttft_ms_p99": 1000 * percentile([s.ttft for s in streams], 0.99),
        "gap_ms_p50": 1000 * percentile(gaps, 0.5),
        "gap_ms_p99": 1000 * percentile(gaps, 0.99),
        "gap_ms_mean": 1000 * mean_gap,
        "gap_ms_max": 1000 * max(gaps, default=0.0),
        # Time per stream spent in gaps longer than twice the median: stalls, not steady steps.
        "stall_ms_per_stream": 1000 * sum(g for g in gaps if g > 2 * median_gap) / max(len(streams), 1),
        "step_ms_p50": 1000 * percentile(steps, 0.5) if steps else None,
        "step_ms_p99": 1000 * percentile(steps, 0.99) if steps else None,
        # Each in-process round's median step: steps of paths that ran in one turn can be paired.
        "step_ms_p50_rounds": [
            round(1000 * percentile(r.step_seconds, 0.5), 3) for r in rounds if r.step_seconds
        ],
        "tokens": tokens,
        # Each round's rate, and the host's steal time in it: a slow round on a virtual machine
        # may be the hypervisor's doing, not the path's.
        "tok_s_rounds": [round(t, 1) for t in totals],
        "host_steal_pct": percentile(steal, 0.5) if steal else None,
        "host_steal_pct_rounds": steal,
        "client_cpu_us_per_token": round(1e6 * client_cpu / tokens, 1) if client_cpu else None,
        "tokens_per_chunk": round(tokens / sum(r.chunks for r in rounds), 3)
        if any(r.chunks for r in rounds)
        else None,
    }
