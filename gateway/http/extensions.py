"""Known request extensions (vLLM, TabbyAPI) normalized into one shape, or refused by name.

Runs in the gateway process, at the API edge. Owns the structured-output spellings: OpenAI's
`response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice` and `structured_outputs`,
TabbyAPI's `json_schema` and `regex_pattern`; each becomes (json_object, json_schema text, regex),
which the worker's constrained decoding enforces. At most one may be given. Grammars are refused:
no engine here can enforce one. The README's parameter table lists every extension.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import InvalidRequest
from gateway.http.json_body import MAX_JSON_DEPTH

# A schema travels in every Generate frame and is parsed per job; real ones are a few KB.
MAX_SCHEMA_CHARS = 64 * 1024
MAX_CHOICES = 256
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_REGEX_SPECIAL = set(".^$*+?{}[]\\|()/")


@dataclass(frozen=True)
class Constraint:
    json_object: bool = False
    json_schema: str | None = None
    regex: str | None = None
    compact_json: bool = False  # no whitespace between JSON tokens


NONE = Constraint()


def response_format_constraint(response_format: dict[str, Any] | None) -> Constraint:
    """OpenAI's response_format; ValueError if it is malformed."""
    if response_format is None:
        return NONE
    kind = response_format.get("type")
    if kind == "text":
        return NONE
    if kind == "json_object":
        return Constraint(json_object=True)
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
        return Constraint(json_object=True)  # a name and no schema: any JSON object
    return Constraint(json_schema=schema_text(schema, "json_schema.schema"))


def schema_text(schema: Any, where: str) -> str:
    """A JSON schema (an object, or JSON text of one) as compact JSON text; ValueError if not one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            schema = None  # nested past what the parser can recurse: refused below, as too deep
        except ValueError:
            raise ValueError(f"{where} is not valid JSON") from None
        # A schema given as text escaped the body's depth check; deeper ones fail where only a 500
        # could say so (the gateway's own json.dumps, the worker's compile).
        if schema is None or _depth(schema) > MAX_JSON_DEPTH:
            raise ValueError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels")
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON object")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{where} must be at most {MAX_SCHEMA_CHARS} characters as JSON")
    return text


def _depth(value: Any) -> int:
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            pending.extend(
                (child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
            )
    return deepest


def choice_regex(choices: list[str]) -> str:
    """A regular expression matching exactly one of `choices` (vLLM's guided_choice)."""
    if not choices or len(choices) > MAX_CHOICES or any(not c for c in choices):
        raise ValueError(f"give 1 to {MAX_CHOICES} non-empty choices")
    escaped = ["".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice) for choice in choices]
    return "(" + "|".join(escaped) + ")"


def _one(field: str, value: Any) -> Constraint:
    """One structured-output field's constraint; InvalidRequest naming the field if malformed."""
    try:
        if field in ("response_format",):
            return response_format_constraint(value)
        if field in ("guided_json", "json_schema", "structured_outputs.json"):
            return Constraint(json_schema=schema_text(value, field))
        if field in ("guided_regex", "regex_pattern", "structured_outputs.regex"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{field} must be a non-empty string")
            return Constraint(regex=value)
        if field in ("guided_choice", "structured_outputs.choice"):
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError(f"{field} must be a list of strings")
            return Constraint(regex=choice_regex(value))
        if field == "structured_outputs.json_object":
            return Constraint(json_object=True) if value else NONE
    except ValueError as exc:
        raise InvalidRequest(f"{field}: {exc}", param=field.split(".")[0]) from None
    raise InvalidRequest(
        f"{field} is not supported: no engine here can enforce it", param=field.split(".")[0]
    )


def structured_output(fields: dict[str, Any]) -> Constraint:
    """The one constraint the request's structured-output fields ask for (None values are absent)."""
    given = {name: value for name, value in fields.items() if value is not None}
    outputs = given.pop("structured_outputs", None)
    compact = False
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
        for key, value in outputs.items():
            if value is None or value is False:
                continue
            if key == "disable_any_whitespace":
                compact = True
                continue
            if key in ("json", "regex", "choice", "json_object"):
                given[f"structured_outputs.{key}"] = value
            else:  # grammar, structural_tag, whitespace options: nothing here enforces them
                raise InvalidRequest(f"structured_outputs.{key} is not supported", param="structured_outputs")
    if (
        given.get("response_format") is not None
        and response_format_constraint(given["response_format"]) == NONE
    ):
        given.pop("response_format")  # {"type": "text"} asks for nothing
    if len(given) > 1:
        names = ", ".join(sorted(given))
        raise InvalidRequest(f"give one structured-output constraint, not several ({names})",
                             param=sorted(given)[0].split(".")[0])  # fmt: skip
    if not given:
        return NONE
    field, value = next(iter(given.items()))
    constraint = _one(field, value)
    return dataclasses.replace(constraint, compact_json=True) if compact else constraint
