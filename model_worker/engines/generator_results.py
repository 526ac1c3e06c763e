"""Dynamic-generator results -> wire outputs: tokens, text, logprobs, finish reasons and usage.

Runs in a worker process, imported by the exllamav2 and exllamav3 engines: exllamav3's generator
returns the same result dictionaries as exllamav2's ("streaming" stage, "token_ids", "held",
"eos_reason", timings). Owns no state: a PartialOutput merges one job's results of one iterate()
call; logprob entries come from the engine's StepLogprobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model_worker.engines.gpu_logprobs import MIN_LOGPROB, Entry
from model_worker.engines.token_texts import TokenTexts
from wire.results import FinishReason, TokenLogprob, Usage

logger = logging.getLogger(__name__)

# A job's next `count` logprob entries (an engine's StepLogprobs.take bound to the job).
TakeEntries = Callable[[int], list[Entry]]


@dataclass
class PartialOutput:
    """One job's output merged over every result of one iterate() (draft decoding yields several)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


def add_tokens(
    part: PartialOutput,
    result: dict[str, Any],
    texts: TokenTexts,
    take: TakeEntries | None,
    drop_last: bool = False,
) -> None:
    """Append one result's text and tokens (and, when the job wants them, one logprob entry per
    token, consumed in order: held-back tokens arrive in a later result, in sampling order)."""
    ids = result["token_ids"][0].tolist() if "token_ids" in result else []
    count = len(ids) - 1 if drop_last and ids else len(ids)
    part.text += result.get("text", "")
    part.token_ids.extend(int(t) for t in ids[:count])
    if take is not None and ids:
        entries = take(len(ids))[:count]  # a dropped stop token's entry is consumed too
        if len(entries) < count:  # every sampled token passes the captured forward pass; a bug if not
            logger.warning("logprobs missing for %d of %d tokens", count - len(entries), count)
            entries += [(MIN_LOGPROB, [])] * (count - len(entries))
        if part.logprobs is not None:
            part.logprobs.extend(
                texts.entry(int(token), logprob, top)
                for token, (logprob, top) in zip(ids, entries, strict=False)
            )


def finish(
    part: PartialOutput,
    result: dict[str, Any],
    prompt_tokens: int,
    pieces: list[str],
    texts: TokenTexts,
    take: TakeEntries | None,
) -> None:
    """A job's last result: what it still held back, why it ended, and its usage."""
    reason = result.get("eos_reason")
    held = result.get("held", {})
    if reason == "stop_token" and held:
        # Text held back (a possible stop-string prefix) ends with the stop token: keep the
        # text, drop the token, as OpenAI does with eos.
        stop_id = int(result["eos_triggering_token_id"])
        piece = pieces[stop_id] if 0 <= stop_id < len(pieces) else ""
        if piece and held.get("text", "").endswith(piece):
            held = {**held, "text": held["text"][: -len(piece)]}
        add_tokens(part, held, texts, take, drop_last=True)
    part.finish_reason = FinishReason.LENGTH if reason == "max_new_tokens" else FinishReason.STOP
    part.usage = Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=int(result.get("new_tokens", len(part.token_ids))),
        cached_tokens=int(result.get("cached_tokens", 0)),
        queue_s=round(float(result.get("time_enqueued", 0.0)), 6),
        prefill_s=round(float(result.get("time_prefill", 0.0)), 6),
        decode_s=round(float(result.get("time_generate", 0.0)), 6),
        accepted_draft_tokens=int(result.get("accepted_draft_tokens", 0)),
        rejected_draft_tokens=int(result.get("rejected_draft_tokens", 0)),
    )
