"""The producer's side of one choice: each worker output becomes the Delta the surfaces format.

Runs in the gateway process, on its asyncio loop, called by the request owner as each worker
frame arrives (once per output, never per token). Owns what must be decided in arrival order,
before an output is queued for the client: stop sequences matched in the gateway (the Messages
API reports which one matched, which a worker's stop cannot say), with the text that may still
grow into one held back; and the usage a finished choice reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.serving.outputs import Delta, FinalUsage
from wire.results import FinishReason, JobOutput


@dataclass(frozen=True)
class TextPlan:
    """What the gateway itself watches for in a request's text."""

    stop_sequences: list[str] = field(default_factory=list)  # matched here, not by the worker


class StopMatcher:
    """Finds the first of `stops` in a text that arrives in pieces; holds back a tail that may be
    the start of one, so no part of a stop sequence is ever sent."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """(the text that may go out now, the stop sequence matched or None); after a match the
        text is cut where the sequence starts."""
        buffer = self.held + text
        found: tuple[int, str] | None = None
        for stop in self.stops:
            at = buffer.find(stop)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            self.held = ""
            return buffer[: found[0]], found[1]
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:size]):
                    hold = size
                    break
        self.held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


class ChoiceText:
    def __init__(self, plan: TextPlan | None = None) -> None:
        self.plan = plan or TextPlan()
        self.prompt_tokens = 0  # the worker's count, from its Accepted
        self.generated_tokens = 0
        self._stops = StopMatcher(self.plan.stop_sequences) if self.plan.stop_sequences else None

    def take(self, output: JobOutput) -> Delta:
        """The Delta for one output of this choice's job. A Delta with a finish_reason on an output
        without one means the gateway ended the choice (a stop sequence): its job must be cancelled."""
        self.generated_tokens += len(output.token_ids)
        text, stop = output.text, None
        finish = output.finish_reason
        if self._stops is not None:
            text, stop = self._stops.feed(text)
            if stop is not None:
                finish = FinishReason.STOP
            elif finish is not None:
                text += self._stops.flush()
        usage = None
        if finish is not None:
            usage = self._usage(output, gateway_ended=output.finish_reason is None)
        return Delta(
            text=text,
            token_count=len(output.token_ids),
            finish_reason=finish,
            usage=usage,
            logprobs=output.logprobs,
            prompt_logprobs=output.prompt_logprobs,
            stop_sequence=stop,
        )

    def _usage(self, output: JobOutput, gateway_ended: bool) -> FinalUsage:
        job = output.usage
        if job is None or gateway_ended:  # the job is cancelled: what it sent is all it made
            return FinalUsage(self.prompt_tokens, self.generated_tokens)
        return FinalUsage(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            cached_tokens=job.cached_tokens,
            queue_s=job.queue_s,
            prefill_s=job.prefill_s,
            decode_s=job.decode_s,
        )
