"""HTTP request schemas of the OpenAI API, and their normalization into wire SamplingParams.

Runs in the gateway process. Owns the API edge: every "string or list" shape the OpenAI API
allows is normalized here, so the rest of the code sees one shape per field. Known extensions
(vLLM's and TabbyAPI's) are declared fields: honoured, or refused with a 400 naming them
(gateway.http.extensions normalizes the structured-output ones); vLLM's that nothing here honours
are refused by name unless given the value that changes nothing. Genuinely unknown fields are
accepted and ignored, as OpenAI clients send vendor extensions freely. Every declared field takes its
own JSON type only (pydantic's strict mode, as on the Responses and Messages routes): `"n": "2"`,
`"max_tokens": true` or `"stream": "true"` is a 400 naming the field, never coerced; a whole number
still fits a float field. Nullable fields, free-form JSON and the refused vLLM fields follow
gateway.http.field_rules. Whether lm-format-enforcer can enforce a schema is the worker's call (it
imports torch, which the gateway never does), answered with an `invalid_response_format` rejection.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config.models import ModelConfig
from gateway.errors import InvalidRequest
from gateway.http.extensions import response_format_constraint, structured_output
from gateway.http.field_rules import UNSUPPORTED_VLLM, NullIsDefault, PlainObject, Refusal, TemplateKwargs
from wire import params as wire

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_MESSAGES = 4096
MAX_TOP_LOGPROBS = 20
MAX_N = 8
# A prompt list is also bounded by the model's max_concurrent_jobs (prompts x n run together); this
# refuses a huge list before anything else looks at it.
MAX_PROMPTS = 256
MAX_WORD_LISTS = 256
# Token ids travel as msgpack ints; bound them here so a wild value is a 400, not an encoder error.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _no_empty_cut(value: int | None) -> int | None:
    if value == 0:
        raise ValueError("must be -1 (the context length) or at least 1")
    return value


# vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens; -1 for the context length.
PromptCutRequest = Annotated[
    int | None,
    Field(ge=-1, lt=2**31, description="vLLM: only the prompt's last k tokens (-1: the context length)."),
    AfterValidator(_no_empty_cut),
]


def prompt_cut(requested: int | None, max_seq_len: int) -> int | None:
    """truncate_prompt_tokens as the worker takes it: None, or the tokens to keep; a 400 naming the
    field when it asks for more than the model's context."""
    if requested is None:
        return None
    if requested == -1:
        return max_seq_len
    if requested > max_seq_len:
        message = f"truncate_prompt_tokens ({requested}) must not exceed the model's context ({max_seq_len})"
        raise InvalidRequest(message, param="truncate_prompt_tokens")
    return requested


# A logit_bias key: a token id in ASCII decimal digits (str.isdigit also takes "١٢" and "²").
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")
# strict: a value of the wrong JSON type is a 400 naming the field, as OpenAI answers it (never read
# as a setting the client did not choose); an int still fits a float field.
_STRICT = ConfigDict(extra="allow", strict=True)
_STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs", "json_schema", "regex_pattern")  # fmt: skip


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="Usage in every chunk (vLLM).")


class _Request(BaseModel):
    model_config = _STRICT
    refused_extras: ClassVar[dict[str, Refusal]] = UNSUPPORTED_VLLM

    model: str = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: NullIsDefault[int] = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Accepted when equal to n (vLLM).")
    stream: NullIsDefault[bool] = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: NullIsDefault[bool] = False
    min_tokens: NullIsDefault[int] = Field(0, ge=0, lt=2**31)
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema (on /v1/completions an extension)."
    )
    # Structured output under other names (vLLM, TabbyAPI); at most one of these and response_format.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = Field(None, description="Refused: no engine here enforces grammars.")
    structured_outputs: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = Field(None, description="TabbyAPI's JSON schema constraint.")
    regex_pattern: str | None = Field(None, description="TabbyAPI's regular expression constraint.")
    # Other known extensions.
    include_stop_str_in_output: NullIsDefault[bool] = False
    banned_strings: str | list[str] | None = Field(None, description="TabbyAPI: strings never generated.")
    bad_words: list[str] | None = Field(None, max_length=MAX_WORD_LISTS)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    thinking_token_budget: int | None = Field(
        None, ge=1, lt=2**31, description="vLLM: thinking tokens at most (a model with a reasoning_parser)."
    )
    truncate_prompt_tokens: PromptCutRequest = None

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_LENGTH or not s for s in stops):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters")
        return stop

    @field_validator("banned_strings")
    @classmethod
    def _banned_caps(cls, banned: str | list[str] | None) -> str | list[str] | None:
        strings = [banned] if isinstance(banned, str) else banned or []
        if len(strings) > MAX_WORD_LISTS or any(not s or len(s) > MAX_STOP_LENGTH for s in strings):
            raise ValueError(f"at most {MAX_WORD_LISTS} banned strings of 1 to {MAX_STOP_LENGTH} characters")
        return banned

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        response_format_constraint(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**31:
                shown = key if len(key) <= 20 else key[:20] + "..."
                raise ValueError(
                    f"logit_bias keys must be token ids in ASCII decimal digits, 0 to {2**31 - 1} "
                    f"(got {shown!r})"
                )
            if not -100.0 <= value <= 100.0:
                raise ValueError("logit_bias values must be within [-100, 100]")
        return bias

    @model_validator(mode="after")
    def _extension_rules(self) -> _Request:
        extra = self.model_extra or {}
        for name, (harmless, reason) in self.refused_extras.items():
            if extra.get(name) is not None and extra[name] not in harmless:
                raise InvalidRequest(reason, param=name)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.best_of is not None and self.best_of != self.n:
            # best_of > n would need ranking by cumulative logprob, which no engine here reports.
            raise InvalidRequest("best_of must equal n (best_of > n is not supported)", param="best_of")
        return self

    def sampling_params(
        self, model: ModelConfig, logprobs: int | None, constraint_schema: str | None = None
    ) -> wire.SamplingParams:
        """The wire parameters; `constraint_schema` (tool calls) replaces any structured output."""
        defaults = model.defaults
        requested = self.requested_max_tokens()
        max_tokens = defaults.max_tokens if requested is None else requested
        if max_tokens > model.max_seq_len:
            param = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) else "max_tokens"
            raise InvalidRequest(
                f"{param} must not exceed the model's context length ({model.max_seq_len})", param=param
            )
        if self.min_tokens > max_tokens:
            raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        constraint = structured_output({name: getattr(self, name) for name in _STRUCTURED_FIELDS})
        if constraint_schema is not None:
            if constraint.json_object or constraint.json_schema or constraint.regex:
                raise InvalidRequest(
                    "a required or named tool_choice cannot be combined with another output constraint",
                    param="tool_choice",
                )
            # Compact: a model that has never seen tools must not spend its tokens on whitespace.
            constraint = type(constraint)(json_schema=constraint_schema, compact_json=True)
        banned = (
            [self.banned_strings] if isinstance(self.banned_strings, str) else list(self.banned_strings or [])
        )
        return wire.SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else max(self.top_k, 0),
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            typical_p=defaults.typical_p if self.typical_p is None else self.typical_p,
            repetition_penalty=(
                defaults.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty
            ),
            frequency_penalty=(
                defaults.frequency_penalty if self.frequency_penalty is None else self.frequency_penalty
            ),
            presence_penalty=defaults.presence_penalty
            if self.presence_penalty is None
            else self.presence_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            json_object=constraint.json_object,
            json_schema=constraint.json_schema,
            regex=constraint.regex,
            compact_json=constraint.compact_json,
            prompt_logprobs=self.prompt_logprobs_count(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            banned_strings=banned,
            bad_words=[w for w in self.bad_words or [] if w],
            allowed_token_ids=list(self.allowed_token_ids or []),
            truncate_prompt_tokens=prompt_cut(self.truncate_prompt_tokens, model.max_seq_len),
        )

    def constraint_field(self, tool_constraint: bool) -> str:
        """The field the client gave the output's constraint in (a worker's refusal of the
        constraint names it): a structured-output field, or `tools` for a tool call's."""
        if tool_constraint:
            return "tools"
        given = [name for name in _STRUCTURED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1 and self.response_format is not None and self.response_format.get("type") == "text":
            given.remove("response_format")  # {"type": "text"} asks for nothing
        return given[0] if given else "response_format"

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_logprobs_count(self) -> int | None:
        return self.prompt_logprobs

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str = Field(..., min_length=1)
    arguments: str = ""


class ToolCallItem(BaseModel):
    """A tool call an assistant message made earlier in the conversation."""

    model_config = _STRICT
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


# Roles whose messages OpenAI's API refuses without content; an assistant's may carry only tool
# calls, and a legacy function result may be null.
_ROLES_NEEDING_CONTENT: list[JsonValue] = ["developer", "system", "tool", "user"]


class ChatMessage(BaseModel):
    # The OpenAPI description says the same as the validator below, so that a client generated from
    # it (or a fuzzer) sends content where the role needs it.
    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "if": {"properties": {"role": {"enum": _ROLES_NEEDING_CONTENT}}},
            "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        },
    )
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = Field(None, description="Legacy: an assistant's one call.")

    @field_validator("content")
    @classmethod
    def _content_where_required(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")  # absent when the role itself failed validation
        if content is None and role in _ROLES_NEEDING_CONTENT:
            raise ValueError(f"a {role} message needs content (a string or a list of content parts)")
        return content

    def to_wire(self) -> wire.ChatMessage:
        """Templates expect `content` as one string; text parts are joined, others refused."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type not in ("text", "input_text", "output_text"):
                    raise InvalidRequest(
                        f"content part type {part.type!r} is not supported", param="messages"
                    )
                if part.text is None:  # a text part without its text: not an unsupported type
                    raise InvalidRequest(f"a content part of type {part.type!r} needs text", param="messages")
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        calls = [wire.ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or []]
        if self.function_call is not None and not calls:  # the legacy functions API's call
            calls = [wire.ToolCall("", self.function_call.name, self.function_call.arguments)]
        return wire.ChatMessage(self.role, content, self.name or None, calls, self.tool_call_id)


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: PlainObject | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


# OpenAI chat parameters that change the output and that nothing here can honour: a 400 naming
# each, never a silent 200 (genuinely unknown fields are still ignored).
_UNSUPPORTED_CHAT = {
    "reasoning_effort": "reasoning_effort is not supported: cap thinking with thinking_token_budget "
    "(models with a reasoning_parser)",
    # OpenRouter's spelling ({effort, max_tokens, exclude, enabled}); null values ask for nothing.
    "reasoning": "reasoning is not supported: cap thinking with thinking_token_budget (models with a "
    "reasoning_parser), switch it with chat_template_kwargs",
    "verbosity": "verbosity is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs (prediction) are not supported",
    "web_search_options": "web search is not supported",
}


class ChatCompletionRequest(_Request):
    refused_extras: ClassVar[dict[str, Refusal]] = {
        **UNSUPPORTED_VLLM,
        # The template writes the special tokens (vLLM's chat default is false).
        "add_special_tokens": (
            (False,),
            "add_special_tokens is not supported on chat: the template adds them",
        ),
        "documents": ((), "documents is not supported: pass them in chat_template_kwargs"),
        "include_reasoning": ((True,), "include_reasoning false is not supported"),
    }
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: NullIsDefault[bool] = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = Field(None, max_length=128, description="Legacy tools.")
    function_call: str | dict[str, Any] | None = Field(None, description="Legacy tool_choice.")
    # The chat template's switches (vLLM).
    add_generation_prompt: NullIsDefault[bool] = True
    continue_final_message: NullIsDefault[bool] = False
    chat_template_kwargs: TemplateKwargs | None = None
    chat_template: str | None = Field(None, description="Refused: the template is the model's (models.yaml).")
    echo: NullIsDefault[bool] = Field(False, description="Refused when true (vLLM's chat echo).")

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _named_function_shape(cls, choice: str | dict[str, Any] | None, info: ValidationInfo) -> Any:
        if not isinstance(choice, dict):
            return choice  # none, auto, required: plan_tools judges the words
        legacy = info.field_name == "function_call"  # {name}, where tool_choice has {type, function: {name}}
        function = choice if legacy else choice.get("function")
        if not isinstance(function, dict) or (not legacy and choice.get("type", "function") != "function"):
            raise ValueError(
                "a named function is " + ("{name}" if legacy else "{type: function, function: {name}}")
            )
        if not isinstance(function.get("name"), str):
            raise ValueError("the function's name must be a string")
        return choice

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.chat_template is not None:
            raise InvalidRequest(
                "chat_template per request is not supported; set a model's template in models.yaml",
                param="chat_template",
            )
        if self.echo:
            raise InvalidRequest("echo is not supported on chat completions", param="echo")
        extra = self.model_extra or {}
        for name, reason in _UNSUPPORTED_CHAT.items():
            value = extra.get(name)
            if name == "reasoning" and isinstance(value, dict) and all(v is None for v in value.values()):
                continue  # {} or {"effort": null}: nothing asked, as the Responses route reads it
            if value is not None:
                raise InvalidRequest(reason, param=name)
        modalities = extra.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise InvalidRequest("only text output is supported (modalities: ['text'])", param="modalities")
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt false", param="continue_final_message"
            )
        if self.functions is not None and self.tools is not None:
            raise InvalidRequest("give tools or the legacy functions, not both", param="functions")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_definitions(self) -> tuple[list[dict[str, Any]] | None, Any]:
        """(tools, tool_choice), the legacy functions / function_call turned into their modern form."""
        if self.functions is not None:
            tools = [
                {"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions
            ]
            choice: Any = self.function_call
            if isinstance(choice, dict):
                choice = {"type": "function", "function": {"name": choice.get("name")}}
            return tools, choice
        if self.tools is None:
            return None, self.tool_choice
        return [t.model_dump(exclude_none=True) for t in self.tools], self.tool_choice

    def chat_options(self, tools: list[wire.ToolSpec]) -> wire.ChatOptions:
        return wire.ChatOptions(
            tools=tools,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            template_kwargs=dict(self.chat_template_kwargs or {}),
        )


class CompletionRequest(_Request):
    refused_extras: ClassVar[dict[str, Refusal]] = {
        **UNSUPPORTED_VLLM,
        "add_special_tokens": ((True,), "add_special_tokens false is not supported: a text prompt gets the "
                               "tokenizer's special tokens (send token ids to choose them)"),
        "prompt_embeds": ((), "prompt_embeds is not supported"),
    }  # fmt: skip
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default for legacy completions; 0 with echo scores the prompt only (lm-eval, vLLM).
    max_tokens: int | None = Field(16, ge=0, lt=2**31)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: NullIsDefault[bool] = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _zero_tokens_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens 0 needs echo (the prompt is all there is)", param="max_tokens")
        if self.thinking_token_budget is not None:
            raise InvalidRequest(
                "thinking_token_budget needs /v1/chat/completions (a completion is not split into thinking "
                "and answer)",
                param="thinking_token_budget",
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    def prompt_logprobs_count(self) -> int | None:
        # echo with logprobs returns the prompt's logprobs too (as vLLM does, and lm-eval reads).
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()


class ModelCard(BaseModel):
    """One served model, as GET /v1/models lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    aliases: list[str]
    engine: str
    max_model_len: int
    context_length: int
    state: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
