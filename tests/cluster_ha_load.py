"""A steady load of streamed completions through a load balancer, and what became of each request.

Runs in the pytest process, on threads of its own. `Load` keeps `concurrency` clients busy, each
sending one streamed completion after another (`ignore_eos`, so a finished stream has exactly
`max_tokens` tokens) with its own X-Request-ID, until it is stopped. Every request ends as one of:
- finished: HTTP 200, the stream ends with `[DONE]` and its usage counts every token asked for;
- failed cleanly: the client was told: an HTTP error status, an SSE `error` event, or the
  connection ended mid-stream (a gateway killed under it: the client sees the end, not a finish);
- lost: anything else: no answer within the timeout, a stream that ends as if all were well but
  short of its tokens or of `[DONE]`, a client error of another kind.
`CaseReport` counts them for one case of a test.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx

FINISHED, FAILED, LOST = "finished", "failed cleanly", "lost"


@dataclass
class Record:
    rid: str
    started: float
    ended: float | None = None
    first_data: float | None = None  # when its first data line arrived
    gateway: str | None = None  # the server HAProxy named in X-Gateway
    status: int | None = None
    outcome: str | None = None
    detail: str = ""

    def ended_after(self, moment: float) -> bool:
        return self.ended is None or self.ended > moment


@dataclass
class CaseReport:
    case: str
    records: list[Record] = field(default_factory=list)

    def of(self, outcome: str) -> list[Record]:
        return [r for r in self.records if r.outcome == outcome]

    @property
    def sent(self) -> int:
        return len(self.records)

    def __str__(self) -> str:
        text = (
            f"{self.case}: sent {self.sent}, finished {len(self.of(FINISHED))}, "
            f"failed cleanly {len(self.of(FAILED))}, lost {len(self.of(LOST))}"
        )
        odd = [f"  {r.rid} via {r.gateway}: {r.outcome}: {r.detail[:200]}" for r in self.records
               if r.outcome != FINISHED]  # fmt: skip
        return "\n".join([text, *odd])


class Load:
    def __init__(
        self,
        url: str,
        case: str,
        *,
        model: str,
        api_key: str,
        concurrency: int,
        max_tokens: int,
        timeout_s: float = 30.0,
    ) -> None:
        self.url = url + "/v1/completions"
        self.case = case
        self.body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True}}  # fmt: skip
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(n,), daemon=True, name=f"load-{case}-{n}")
            for n in range(concurrency)
        ]
        self.timeout_s = timeout_s

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    def streaming_via(self, gateway: str) -> list[Record]:
        """Requests of `gateway` that are mid-stream now."""
        return [r for r in self.snapshot() if r.gateway == gateway and r.first_data and r.ended is None]

    def finished_after(self, moment: float) -> int:
        return sum(1 for r in self.snapshot() if r.outcome == FINISHED and r.started > moment)

    def stop(self) -> CaseReport:
        """No new request; each one sent runs to its end (its timeout at most)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)
        report = CaseReport(self.case, self.snapshot())
        for record in report.records:
            if record.outcome is None:  # its client never came back
                record.outcome, record.detail = LOST, "no end"
        return report

    def _client(self, n: int) -> None:
        # A connection per request: haproxy answers a request it could not deliver on a first
        # request with a 502 (and logs it), where on a kept connection it would close it silently.
        with httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            sent = 0
            while not self._stop.is_set():
                record = Record(f"{self.case.replace(' ', '-')}-{n}-{sent}", time.monotonic())
                sent += 1
                with self._lock:
                    self.records.append(record)
                self._one(client, record)

    def _one(self, client: httpx.Client, record: Record) -> None:
        headers = {**self.headers, "X-Request-ID": record.rid}
        try:
            with client.stream("POST", self.url, json=self.body, headers=headers) as response:
                record.gateway = response.headers.get("x-gateway")
                record.status = response.status_code
                if response.status_code != 200:
                    record.outcome = FAILED
                    record.detail = f"HTTP {response.status_code}: {response.read().decode(errors='replace')}"
                    return
                record.outcome, record.detail = self._read(response, record)
        except httpx.TimeoutException as exc:
            record.outcome, record.detail = LOST, f"no answer: {type(exc).__name__}: {exc}"
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            record.outcome, record.detail = FAILED, f"connection ended: {type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:
            record.outcome, record.detail = LOST, f"{type(exc).__name__}: {exc}"
        finally:
            record.ended = time.monotonic()

    def _read(self, response: httpx.Response, record: Record) -> tuple[str, str]:
        data: list[str] = []
        error_event = False
        for line in response.iter_lines():
            if line == "event: error":
                error_event = True
            elif line.startswith("data: "):
                record.first_data = record.first_data or time.monotonic()
                data.append(line[6:])
        if error_event:
            errors = [d for d in data if d != "[DONE]" and "error" in json.loads(d)]
            return FAILED, "error event: " + (errors[-1] if errors else "(no data)")
        if not data or data[-1] != "[DONE]":
            return LOST, f"the stream ended without [DONE] after {len(data)} data lines"
        usage = [u for d in data[:-1] if (u := json.loads(d).get("usage"))]
        tokens = int(usage[-1]["completion_tokens"]) if usage else -1
        if tokens != self.max_tokens:
            return LOST, f"finished with {tokens} of {self.max_tokens} tokens"
        return FINISHED, ""
