"""Every message between the gateway and a worker, and the protocol's codec.

Imported by the gateway and by every worker; declares only inter-process structs (the fields of
each once, in wire order) and `PROTOCOL`, the codec that knows them all. Requests carry a `rid`
(one engine job, or one tokenize exchange); a worker answers Generate with Accepted or Rejected
before any Step mentions the job, so the gateway can answer an HTTP error before a stream opens.

gateway -> worker: Generate, Cancel, Tokenize, Detokenize, Embed, Shutdown, Reintroduce
worker -> gateway: Hello, Status, Ready, Accepted, Rejected, Tokens, Embeddings, Step, JobsAborted,
                   Heartbeat, Fatal
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from wire.codec import Codec, Message
from wire.params import ChatMessage, ChatOptions, SamplingParams
from wire.results import AbortReason, JobOutput, RejectCode
from wire.states import WorkerState
from wire.stats import EngineInfo, EngineStats, TokenizerInfo

# Sent in Hello; a gateway refuses a worker that speaks another version.
PROTOCOL_VERSION = 3

# ---- gateway -> worker -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Generate(Message):
    """Start one job. Exactly one of prompt, prompt_token_ids, messages is set."""

    rid: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    params: SamplingParams
    chat: ChatOptions | None = None  # with messages: tools and the template's switches
    TAG: ClassVar[str] = "gen"

    def check(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages))
        if given != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages must be set")


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    rid: str
    TAG: ClassVar[str] = "cancel"


@dataclass(frozen=True, slots=True)
class Tokenize(Message):
    """Tokenize a prompt, or chat messages rendered with the model's template; answered by Tokens."""

    rid: str
    prompt: str | None
    messages: list[ChatMessage] | None
    add_special_tokens: bool
    chat: ChatOptions | None = None
    TAG: ClassVar[str] = "tok"


@dataclass(frozen=True, slots=True)
class Detokenize(Message):
    rid: str
    token_ids: list[int]
    TAG: ClassVar[str] = "detok"


@dataclass(frozen=True, slots=True)
class Embed(Message):
    """Embed texts or token-id inputs (exactly one is set) with an embedding model; answered by
    Embeddings, one vector per input in order. The worker batches the inputs of every Embed it has."""

    rid: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    TAG: ClassVar[str] = "embed"

    def check(self) -> None:
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("exactly one of texts, token_ids must be set")


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Stop accepting jobs, abort what is left after `grace_s`, then exit."""

    grace_s: float
    TAG: ClassVar[str] = "shutdown"


@dataclass(frozen=True, slots=True)
class Reintroduce(Message):
    """The gateway does not know this worker (it restarted): send Hello, and Ready if ready."""

    TAG: ClassVar[str] = "reintro"


# ---- worker -> gateway -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame from a worker: who it is and which protocol it speaks."""

    version: int
    worker_id: str
    pid: int
    TAG: ClassVar[str] = "hello"


@dataclass(frozen=True, slots=True)
class Status(Message):
    """Lifecycle progress: loading or warming (progress in [0, 1] or None), or draining; `stopped` is a
    worker's last frame before its process exits, so the gateway need not wait for a heartbeat timeout."""

    state: WorkerState
    detail: str
    progress: float | None
    TAG: ClassVar[str] = "status"


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """Model loaded and warmed up."""

    info: EngineInfo
    pid: int
    load_s: float
    warmup_s: float
    chat_template: bool
    tokenizer: TokenizerInfo | None = None
    TAG: ClassVar[str] = "ready"


@dataclass(frozen=True, slots=True)
class Accepted(Message):
    rid: str
    prompt_tokens: int
    TAG: ClassVar[str] = "acc"


@dataclass(frozen=True, slots=True)
class Rejected(Message):
    """The request was refused before it started."""

    rid: str
    code: RejectCode
    message: str
    param: str | None
    TAG: ClassVar[str] = "rej"


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """The answer to Tokenize or Detokenize: the ids and the text they stand for."""

    rid: str
    token_ids: list[int]
    text: str
    TAG: ClassVar[str] = "toks"


@dataclass(frozen=True, slots=True)
class Embeddings(Message):
    """The answer to Embed: one vector per input, and the tokens they took."""

    rid: str
    vectors: list[list[float]]
    prompt_tokens: int
    TAG: ClassVar[str] = "embs"


@dataclass(frozen=True, slots=True)
class Step(Message):
    """Every active job's new output from one generator step, in one frame."""

    outputs: list[JobOutput]
    TAG: ClassVar[str] = "step"


@dataclass(frozen=True, slots=True)
class JobsAborted(Message):
    """The worker ended these unfinished jobs itself (its drain grace ran out)."""

    rids: list[str]
    reason: AbortReason
    message: str
    TAG: ClassVar[str] = "aborted"


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Liveness, the worker's own state, and its engine's load figures."""

    state: WorkerState
    stats: EngineStats
    TAG: ClassVar[str] = "hb"


@dataclass(frozen=True, slots=True)
class Fatal(Message):
    """The worker hit an unrecoverable error and is about to exit."""

    message: str
    TAG: ClassVar[str] = "fatal"


PROTOCOL = Codec(
    [
        Generate, Cancel, Tokenize, Detokenize, Embed, Shutdown, Reintroduce,
        Hello, Status, Ready, Accepted, Rejected, Tokens, Embeddings, Step, JobsAborted, Heartbeat, Fatal,
    ]
)  # fmt: skip
encode = PROTOCOL.encode
decode = PROTOCOL.decode
