"""What a worker sends back about jobs: outputs per step, usage, logprobs, and why a job ended.

Imported by the worker (engines build these) and by the gateway (which turns them into OpenAI
chunks). One shape per concept: logprobs always carry the token's text and id, finish and abort
reasons are enums, usage is a struct, and an abort is its own message, never a finish reason.
"""

from __future__ import annotations

import enum

from wire.codec import Count, Finite, Struct


class FinishReason(str, enum.Enum):
    """How a job ended on its own; OpenAI's finish_reason values."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens, or the context is full


class AbortReason(str, enum.Enum):
    """Why a worker ended jobs that had not finished (the JobsAborted message)."""

    SHUTDOWN = "shutdown"  # the worker's drain grace period ran out
    GATEWAY_GONE = (
        "gateway_gone"  # the worker lost this gateway (no frame for its timeout, or its link broke)
    )


class RejectCode(str, enum.Enum):
    """Why a worker refused a request before it started (the Rejected message); OpenAI error codes."""

    INVALID_REQUEST = "invalid_request"
    INVALID_PROMPT = "invalid_prompt"
    INVALID_VALUE = "invalid_value"
    INVALID_MESSAGES = "invalid_messages"
    INVALID_TOKENS = "invalid_tokens"
    INVALID_RESPONSE_FORMAT = "invalid_response_format"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CHAT_TEMPLATE_MISSING = "chat_template_missing"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    SHUTTING_DOWN = "service_unavailable"  # the worker is draining: a server condition, not the client's
    WORKER_FULL = (
        "worker_full"  # its own cap and queue are full (jobs from several gateways): retry elsewhere
    )


class Usage(Struct, frozen=True):
    """A finished job's token counts and engine-side timings (seconds)."""

    prompt_tokens: Count
    completion_tokens: Count
    cached_tokens: Count = 0
    queue_s: Finite = 0.0
    prefill_s: Finite = 0.0
    decode_s: Finite = 0.0
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0


class TopLogprob(Struct, frozen=True):
    """`raw` holds the token's bytes only when they are not its text's UTF-8: part of a character,
    whose text is U+FFFD (model_worker.engines.token_bytes)."""

    token: str
    token_id: int
    logprob: Finite
    raw: bytes | None = None


class TokenLogprob(Struct, frozen=True):
    """One token's log-probability and, when asked for, its most likely alternatives.

    `logprob` is None only for a prompt's first token, which has no context to be scored in.
    `rank` (1 = the most likely token) is set for prompt tokens, as vLLM's prompt_logprobs report it.
    `raw` as in TopLogprob.
    """

    token: str
    token_id: int
    logprob: Finite | None
    top: list[TopLogprob]
    rank: int | None = None
    raw: bytes | None = None


class JobOutput(Struct, frozen=True):
    """One job's progress in one generator step. `usage` is set on the job's last output, the one
    with a `finish_reason`. `logprobs`, when asked for, has one entry per id in `token_ids`.
    `prompt_logprobs`, when asked for, comes on the job's first output: one entry per prompt token
    after the first (the first token has no context to be scored in)."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
