"""Rules for request fields shared by the OpenAI schemas (gateway.http.schemas).

Runs in the gateway process, at the API edge. Owns three kinds of field rule: null read as a
field's default where OpenAI marks the field nullable (the SDKs send null for a parameter passed as
None); free-form JSON (a tool's parameters, template variables) checked against the wire's rules, so
that it never fails later where only a 500 could say so; and vLLM's extensions that would change
the output and that nothing here honours, refused by name unless given the value that changes nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic_core import PydanticUseDefault

from wire import params as wire
from wire.codec import MAX_PLAIN_DEPTH, check_plain

T = TypeVar("T")


def _null_is_default(value: Any) -> Any:
    if value is None:
        raise PydanticUseDefault()
    return value


def _or_null(schema: dict[str, Any]) -> None:
    """The OpenAPI description of a NullIsDefault field: its own schema, or null."""
    own = {key: schema.pop(key) for key in list(schema) if key not in ("default", "title", "description")}
    schema["anyOf"] = [own, {"type": "null"}]


# A field OpenAI marks nullable that has a default: null means what leaving it out means.
NullIsDefault = Annotated[T, BeforeValidator(_null_is_default), Field(json_schema_extra=_or_null)]


def plain_json(value: Any) -> Any:
    """`value`, if the wire can carry it as free-form data (wire.codec.check_plain); ValueError if
    not, for a 400 naming the field instead of a 500 when the wire message is built."""
    try:
        check_plain(value, "")
    except ValueError as exc:
        reason = str(exc).removeprefix(": ")
        raise ValueError(
            f"not plain JSON ({reason}): numbers must be finite and nesting at most {MAX_PLAIN_DEPTH} deep"
        ) from None
    return value


def _template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = wire.RESERVED_TEMPLATE_VARIABLES & set(kwargs)
    if reserved:
        raise ValueError(f"may not set {sorted(reserved)}: the chat template gets them from the request")
    plain_json(kwargs)
    return kwargs


# A JSON object the wire carries as free-form data (a tool's parameters).
PlainObject = Annotated[dict[str, Any], AfterValidator(plain_json)]
# Extra variables for the chat template (vLLM's chat_template_kwargs).
TemplateKwargs = Annotated[dict[str, Any], AfterValidator(_template_variables)]


# An undeclared field nothing here honours: (the values that change nothing, the refusal's message).
Refusal = tuple[tuple[Any, ...], str]
# vLLM's extensions that would change the output and that nothing here honours: null, or a value
# that changes nothing, is accepted; any other value is a 400 naming the field.
UNSUPPORTED_VLLM: dict[str, Refusal] = {
    "use_beam_search": ((False,), "use_beam_search is not supported"),
    "length_penalty": ((1.0,), "length_penalty is not supported (it weighs beams; no beam search here)"),
    "skip_special_tokens": ((True,), "skip_special_tokens false is not supported (they are skipped)"),
    "spaces_between_special_tokens": ((True,), "spaces_between_special_tokens false is not supported"),
    "logits_processors": (([],), "logits_processors is not supported"),
    "guided_decoding_backend": (("auto",), "guided_decoding_backend is not supported (each engine has one)"),
    "guided_whitespace_pattern": ((), "guided_whitespace_pattern is not supported"),
    "structural_tag": ((), "structural_tag is not supported"),
    "return_tokens_as_token_ids": ((False,), "return_tokens_as_token_ids is not supported"),
    "return_token_ids": ((False,), "return_token_ids is not supported"),
    "repetition_detection": ((), "repetition_detection is not supported"),
    "vllm_xargs": (({},), "vllm_xargs is not supported"),
    "priority": ((0,), "priority is not supported in the body: send the X-Priority header (a class name)"),
}
