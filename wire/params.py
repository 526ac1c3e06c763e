"""What the gateway asks of a worker: sampling parameters, chat messages and the worker's spec.

Imported by the gateway (which builds these at the API edge, already validated and normalized) and
by the worker (which receives them in Generate and on its command line). The structs that travel in
frames are wire.codec Structs, whose wire form and validation msgspec derives from the type hints;
`WorkerSpec` never travels in a frame (it is JSON on the worker's command line) and is a dataclass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from wire.codec import Finite, PromptCut, Struct, check_plain


class SamplingParams(Struct, frozen=True):
    """Everything the engine needs to run one job; already validated and normalized at the API edge."""

    max_tokens: int = 256
    temperature: Finite = 1.0
    top_p: Finite = 1.0
    top_k: int = 0
    min_p: Finite = 0.0
    typical_p: Finite = 1.0
    repetition_penalty: Finite = 1.0
    frequency_penalty: Finite = 0.0
    presence_penalty: Finite = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs. 0: logprob of the chosen token only. k > 0: also the top k alternatives.
    logprobs: int | None = None
    logit_bias: dict[int, Finite] = {}
    # Structured output: json_object asks for any JSON object; json_schema (JSON text) for one
    # matching that schema. Engines enforce it by constrained decoding.
    json_object: bool = False
    json_schema: str | None = None
    # Structured output by a regular expression (guided_regex, guided_choice, regex_pattern).
    regex: str | None = None
    # No whitespace between JSON tokens (vLLM's disable_any_whitespace; tool-call constraints).
    compact_json: bool = False
    # Prompt scoring: None, or k >= 0 for each prompt token's logprob (after the first) and its top k.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Strings that must never appear in the output (TabbyAPI's banned_strings).
    banned_strings: list[str] = []
    # Words whose token sequences must never be generated (vLLM's bad_words).
    bad_words: list[str] = []
    # When non-empty, the only token ids that may be generated (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] = []
    # vLLM's truncate_prompt_tokens: None keeps the whole prompt; k keeps only its last k tokens,
    # cut after tokenizing and templating (the gateway has turned -1 into the context length).
    truncate_prompt_tokens: PromptCut | None = None

    def with_seed(self, seed: int | None) -> SamplingParams:
        return msgspec.structs.replace(self, seed=seed)


class ToolCall(Struct, frozen=True):
    """A function call an assistant made earlier in the conversation; `arguments` is JSON text."""

    id: str
    name: str
    arguments: str


class ChatMessage(Struct, frozen=True):
    """One chat message as the model's chat template sees it (content already one string)."""

    role: str
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments_for_template(c.arguments)}}
                for c in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments_for_template(arguments: str) -> Any:
    # Templates (Llama 3.1, Qwen, Hermes) write arguments with `| tojson`: they expect a mapping,
    # while the API carries JSON text. vLLM hands templates the parsed object the same way.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class ToolSpec(Struct, frozen=True):
    """A function the model may call, as chat templates and constrained decoding see it."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def __post_init__(self) -> None:
        check_plain(self.parameters, "parameters")

    def for_template(self) -> dict[str, Any]:
        # OpenAI's key order (templates write tools with tojson, so the order is in the prompt).
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# Variables the worker's template renderer sets itself: template_kwargs may not replace them (the
# gateway refuses them by name at the API edge, the worker when it renders).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


class ChatOptions(Struct, frozen=True):
    """How the worker renders chat messages: tools for the template and the template's switches."""

    tools: list[ToolSpec] = []
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Extra variables for the template (vLLM's chat_template_kwargs), e.g. enable_thinking.
    template_kwargs: dict[str, Any] = {}

    def __post_init__(self) -> None:
        check_plain(self.template_kwargs, "template_kwargs")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message exclude each other")


# Registry defaults that both processes apply: the gateway to the entries it validates, a remote
# worker to the same file it reads on its own host.
DEFAULT_ENGINE = "exllamav2"
DEFAULT_MAX_SEQ_LEN = 4096
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_MAX_CONCURRENT_JOBS = 8
DEFAULT_BURST_GATHER_MS = 40.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What a worker process needs to serve one model: written by the gateway for the workers it
    spawns, or built by a remote worker from its own copy of the registry.

    `engine_settings` is the engine's own section of the registry entry. The gateway does not know
    its fields: the engine's settings model (model_worker/engines/<engine>/settings.py) validates it
    at config time and again in the worker.
    """

    name: str
    engine: str
    path: str
    max_seq_len: int
    engine_settings: dict[str, Any]
    chat_template: str | None = None
    heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S
    warmup_runs: int = 2
    # The model's `env` from the registry: set in the worker before its engine is imported.
    env: dict[str, str] = field(default_factory=dict)
    task: str = "generate"  # or "embed": the model answers /v1/embeddings only
    # Budgets for compiling a job's output constraint (model_worker.constraints).
    max_constraint_states: int = 4096
    max_constraint_compile_s: float = 5.0
    # An idle worker given a job waits up to this long for the rest of a burst (model_worker.serve_loop).
    admission_window_s: float = 0.0
    # An idle worker given a job its gateway sent ahead of others it was still admitting waits up to
    # this long for them (wire.messages.Generate.following; model_worker.serve_loop).
    burst_gather_s: float = DEFAULT_BURST_GATHER_MS / 1000
    # The worker's own admission (model_worker.jobs): at most max_jobs running and max_queue waiting,
    # refused beyond (worker_full). 0: no cap of its own (a spawned worker; its gateway admits).
    max_jobs: int = 0
    max_queue: int = 0
    # A worker that listens (serves several gateways) forgets a gateway silent for this long.
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    # A listening worker of a `load: on_demand` model (cluster mode) starts in standby, without its
    # model, and loads it when the leading gateway sends Load.
    standby: bool = False
