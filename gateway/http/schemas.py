"""HTTP request schemas of the OpenAI API, and their normalization into wire SamplingParams.

Runs in the gateway process. Owns the API edge: every "string or list" shape the OpenAI API
allows is normalized here, so the rest of the code sees one shape per field. Unknown fields are
accepted and ignored, as OpenAI clients send vendor extensions freely. `response_format` is checked
for shape only: whether lm-format-enforcer can enforce a schema is the worker's call (it imports
torch, which the gateway never does), answered with an `invalid_response_format` rejection.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.config.registry import ModelConfig
from gateway.errors import InvalidRequest
from wire import params as wire

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_MESSAGES = 4096
MAX_TOP_LOGPROBS = 20
MAX_N = 8
# A schema travels in every Generate frame and is parsed per job; real ones are a few KB.
MAX_SCHEMA_CHARS = 64 * 1024
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
# Token ids travel as msgpack ints; bound them here so a wild value is a 400, not an encoder error.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    timeout: float | None = Field(None, gt=0, description="Per-request deadline in seconds (extension).")
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema (on /v1/completions an extension)."
    )

    @field_validator("stop")
    @classmethod
    def _stop_caps(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_LENGTH or not s for s in stops):
            raise ValueError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters")
        return stop

    @field_validator("response_format")
    @classmethod
    def _response_format_shape(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        structured_output(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit() or int(key) >= 2**31:
                raise ValueError("logit_bias keys must be token ids")
            if not -100.0 <= value <= 100.0:
                raise ValueError("logit_bias values must be within [-100, 100]")
        return bias

    def sampling_params(self, model: ModelConfig, logprobs: int | None) -> wire.SamplingParams:
        defaults = model.defaults
        max_tokens = self.requested_max_tokens() or defaults.max_tokens
        if max_tokens > model.max_seq_len:
            param = "max_completion_tokens" if getattr(self, "max_completion_tokens", None) else "max_tokens"
            raise InvalidRequest(
                f"{param} must not exceed the model's context length ({model.max_seq_len})", param=param
            )
        if self.min_tokens > max_tokens:
            raise InvalidRequest("min_tokens must not exceed max_tokens", param="min_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        json_object, json_schema = structured_output(self.response_format)
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
            json_object=json_object,
            json_schema=json_schema,
        )

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def structured_output(response_format: dict[str, Any] | None) -> tuple[bool, str | None]:
    """(json_object, json_schema as JSON text) for a response_format; ValueError if it is malformed."""
    if response_format is None:
        return False, None
    kind = response_format.get("type")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind != "json_schema":
        raise ValueError("type must be one of 'text', 'json_object', 'json_schema'")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("json_schema must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise ValueError("json_schema.name must be 1 to 64 letters, digits, underscores or dashes")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ValueError("json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if schema is None:
        return True, None  # a name and no schema: any JSON object
    if not isinstance(schema, dict):
        raise ValueError("json_schema.schema must be a JSON object")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"json_schema.schema must be at most {MAX_SCHEMA_CHARS} characters as JSON")
    return False, text


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_wire(self) -> wire.ChatMessage:
        """Templates expect `content` as one string; text parts are joined, others refused."""
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"content part type {part.type!r} is not supported", param="messages"
                    )
                texts.append(part.text)
            content = "".join(texts)
        else:
            content = self.content or ""
        return wire.ChatMessage(self.role, content, self.name or None)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for legacy completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]


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
