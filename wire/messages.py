"""Every message between the gateway and a worker, and the protocol's codec.

Imported by the gateway and by every worker; declares only inter-process structs (msgspec Structs
from wire.codec: the fields of each once, in wire order) and `PROTOCOL`, the codec that knows them
all. Requests carry a `rid`
(one engine job, or one tokenize exchange); a worker answers Generate with Accepted or Rejected
before any Step mentions the job, so the gateway can answer an HTTP error before a stream opens.

gateway -> worker: Generate, Cancel, Tokenize, Detokenize, Embed, Shutdown, Retire, Load, Unload,
                   Reintroduce, Ping
worker -> gateway: Hello, Status, Ready, Accepted, Rejected, Tokens, Embeddings, Step, JobsAborted,
                   Heartbeat, Fatal
"""

from __future__ import annotations

from typing import ClassVar

from wire.codec import Codec, Count, Finite, Message, PromptCut
from wire.params import ChatMessage, ChatOptions, SamplingParams
from wire.results import AbortReason, JobOutput, RejectCode
from wire.states import WorkerState
from wire.stats import EngineInfo, EngineStats, TokenizerInfo, WorkerLoad
from wire.trace_context import TraceParent

# Sent in Hello; a gateway refuses a worker that speaks another version. 4: Generate and Embed carry
# the request's trace context (`traceparent`). A version 3 frame still decodes (the field is trailing
# and optional), but a version 3 worker would refuse every version 4 Generate, so the version says so.
# 5: Ping (a gateway's liveness, for workers that serve several gateways), the worker's load in
# Heartbeat, and the worker_full and gateway_gone codes: a version 4 worker would drop every Ping.
# 6: Retire (the leading gateway stops a listening worker for every gateway).
# 7: Load and Unload (the leading gateway loads a standby worker's model and unloads it again), the
# standby period in Status (`epoch`) and the worker's idle time in its load (`idle_s`).
# 8: Generate says how many requests its gateway is still admitting behind it (`following`): a
# version 7 worker would refuse every Generate of version 8.
# 9: logprob entries carry the bytes of a token that is part of a character (`raw`): a version 8
# gateway would refuse every such Step.
# 10: a job's parameters and Embed carry `truncate_prompt_tokens`: a version 9 worker would refuse
# every Generate of version 10.
PROTOCOL_VERSION = 10

# ---- gateway -> worker -------------------------------------------------------------------------


class Generate(Message, frozen=True):
    """Start one job. Exactly one of prompt, prompt_token_ids, messages is set. `traceparent`, set
    only while the gateway traces, is the W3C trace context of the gateway's request span: the
    worker's span for this job becomes its child (wire.trace_context). `following`: the requests the
    gateway was still admitting when it sent this one (for this model, or not yet parsed far enough
    to know), so that an idle worker can start a burst in one step (model_worker.serve_loop)."""

    rid: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    params: SamplingParams
    chat: ChatOptions | None = None  # with messages: tools and the template's switches
    traceparent: TraceParent | None = None
    following: Count = 0
    TAG: ClassVar[str] = "gen"

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages))
        if given != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids, messages must be set")


class Cancel(Message, frozen=True):
    rid: str
    TAG: ClassVar[str] = "cancel"


class Tokenize(Message, frozen=True):
    """Tokenize a prompt, or chat messages rendered with the model's template; answered by Tokens."""

    rid: str
    prompt: str | None
    messages: list[ChatMessage] | None
    add_special_tokens: bool
    chat: ChatOptions | None = None
    TAG: ClassVar[str] = "tok"


class Detokenize(Message, frozen=True):
    rid: str
    token_ids: list[int]
    TAG: ClassVar[str] = "detok"


class Embed(Message, frozen=True):
    """Embed texts or token-id inputs (exactly one is set) with an embedding model; answered by
    Embeddings, one vector per input in order. The worker batches the inputs of every Embed it has.
    `traceparent` as in Generate."""

    rid: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    traceparent: TraceParent | None = None
    truncate_prompt_tokens: PromptCut | None = None  # keep each input's last k tokens
    TAG: ClassVar[str] = "embed"

    def __post_init__(self) -> None:
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("exactly one of texts, token_ids must be set")


class Shutdown(Message, frozen=True):
    """Stop accepting jobs, abort what is left after `grace_s`, then exit."""

    grace_s: Finite
    TAG: ClassVar[str] = "shutdown"


class Retire(Message, frozen=True):
    """Cluster mode: the leading gateway stops this worker for every gateway (a listening worker
    takes Shutdown as one gateway letting go). Drain for `grace_s`, abort what is left, exit; its
    etcd registration is revoked on the way out, so every gateway forgets it."""

    grace_s: Finite
    TAG: ClassVar[str] = "retire"


class Load(Message, frozen=True):
    """Cluster mode: the leading gateway asks a standby worker (state unloaded) to load its model
    and warm up, then serve as any worker. `epoch` is the standby period the load was decided for
    (Status.epoch): a Load for another period, or one that finds the worker loading or ready, is
    ignored, so a Load sent twice (by a leader and its successor) loads the model once."""

    epoch: Count
    TAG: ClassVar[str] = "load"


class Unload(Message, frozen=True):
    """Cluster mode: the leading gateway sends a loaded worker back to standby (idle, or its
    exclusive group's GPUs are wanted by another model). Drain for `grace_s`, abort what is left,
    close the engine (its memory is freed), report unloaded; the process stays, registered.
    `epoch` is the standby period the model was loaded from; an Unload for another is ignored."""

    grace_s: Finite
    epoch: Count
    TAG: ClassVar[str] = "unload"


class Reintroduce(Message, frozen=True):
    """The gateway does not know this worker (it restarted): send Hello, and Ready if ready."""

    TAG: ClassVar[str] = "reintro"


class Ping(Message, frozen=True):
    """A gateway's liveness, every heartbeat interval, to each worker it connected to (cluster mode).
    A worker that serves several gateways cancels the jobs of one it has not heard from for its
    heartbeat timeout. The first Ping that gets through also makes the worker introduce itself."""

    TAG: ClassVar[str] = "ping"


# ---- worker -> gateway -------------------------------------------------------------------------


class Hello(Message, frozen=True):
    """First frame from a worker: who it is and which protocol it speaks. Its fields never change
    between protocol versions, so a gateway reads any worker's version and refuses a mismatch."""

    version: int
    worker_id: str
    pid: int
    TAG: ClassVar[str] = "hello"


class Status(Message, frozen=True):
    """Lifecycle progress: loading or warming (progress in [0, 1] or None), or draining; `stopped` is a
    worker's last frame before its process exits, so the gateway need not wait for a heartbeat timeout.
    `unloaded` (cluster mode) says the worker stands by without a model; `epoch` then counts its
    standby periods (1 for the first), which the leading gateway names its Load and Unload by."""

    state: WorkerState
    detail: str
    progress: Finite | None
    epoch: Count | None = None
    TAG: ClassVar[str] = "status"


class Ready(Message, frozen=True):
    """Model loaded and warmed up."""

    info: EngineInfo
    pid: int
    load_s: Finite
    warmup_s: Finite
    chat_template: bool
    tokenizer: TokenizerInfo | None = None
    TAG: ClassVar[str] = "ready"


class Accepted(Message, frozen=True):
    rid: str
    prompt_tokens: Count
    TAG: ClassVar[str] = "acc"


class Rejected(Message, frozen=True):
    """The request was refused before it started."""

    rid: str
    code: RejectCode
    message: str
    param: str | None
    TAG: ClassVar[str] = "rej"


class Tokens(Message, frozen=True):
    """The answer to Tokenize or Detokenize: the ids and the text they stand for."""

    rid: str
    token_ids: list[int]
    text: str
    TAG: ClassVar[str] = "toks"


class Embeddings(Message, frozen=True):
    """The answer to Embed: one vector per input, and the tokens they took."""

    rid: str
    vectors: list[list[Finite]]
    prompt_tokens: Count
    TAG: ClassVar[str] = "embs"


class Step(Message, frozen=True):
    """Every active job's new output from one generator step, in one frame."""

    outputs: list[JobOutput]
    TAG: ClassVar[str] = "step"


class JobsAborted(Message, frozen=True):
    """The worker ended these unfinished jobs itself (its drain grace ran out)."""

    rids: list[str]
    reason: AbortReason
    message: str
    TAG: ClassVar[str] = "aborted"


class Heartbeat(Message, frozen=True):
    """Liveness, the worker's own state, its engine's figures, and the jobs it admits (`load`: what
    the gateways route by; each gateway is told which of the jobs are its own)."""

    state: WorkerState
    stats: EngineStats
    load: WorkerLoad | None = None
    TAG: ClassVar[str] = "hb"


class Fatal(Message, frozen=True):
    """The worker hit an unrecoverable error and is about to exit."""

    message: str
    TAG: ClassVar[str] = "fatal"


PROTOCOL = Codec(
    [
        Generate, Cancel, Tokenize, Detokenize, Embed, Shutdown, Retire, Load, Unload, Reintroduce, Ping,
        Hello, Status, Ready, Accepted, Rejected, Tokens, Embeddings, Step, JobsAborted, Heartbeat, Fatal,
    ]
)  # fmt: skip
encode = PROTOCOL.encode
decode = PROTOCOL.decode
