"""The base of every registry schema (config/models.yaml): `StrictModel`, and located errors.

Runs in the gateway process (and in `gateway check-config`). Owns the rules every section shares:
unknown keys are errors, a loaded config is frozen, numbers are finite (no .nan or .inf), a whole
number fits the 32-bit integers that engines and the wire use, and true/false is not a number
(pydantic would read `gpus: [true]` as GPU 1). Strings that hold numbers stay accepted: `${VAR}`
expands to text. `field_errors` builds an error for a check across fields that names each field.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_CONFIG_INT = 2**31 - 1

# Where in a model a problem is, as pydantic's error locations are: field names and list indices.
Location = tuple[str | int, ...]


def _leaf_types(annotation: Any) -> list[Any]:
    """The plain types an annotation is made of: int | None -> [int, NoneType], list[int] -> [int]."""
    origin = typing.get_origin(annotation)
    arguments = typing.get_args(annotation)
    if origin is Literal:
        return [type(value) for value in arguments]
    if origin is typing.Annotated:
        return _leaf_types(arguments[0])
    if arguments:
        return [leaf for argument in arguments for leaf in _leaf_types(argument)]
    return [annotation]


def _takes_numbers_not_booleans(annotation: Any) -> bool:
    leaves = _leaf_types(annotation)
    return (int in leaves or float in leaves) and bool not in leaves and Any not in leaves


def _holds(value: Any, kind: type) -> list[Any]:
    """`value` itself, or the items of lists in it, that are of `kind`."""
    if isinstance(value, list | tuple):
        return [found for item in value for found in _holds(item, kind)]
    return [value] if isinstance(value, kind) else []


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _takes_numbers_not_booleans(field.annotation) and _holds(value, bool):
            raise ValueError("true/false is not a number; write the number")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _whole_numbers_fit(cls, value: Any) -> Any:
        numbers = [number for number in _holds(value, int) if not isinstance(number, bool)]
        if any(abs(number) > MAX_CONFIG_INT for number in numbers):
            raise ValueError(f"must be at most {MAX_CONFIG_INT}")
        return value


def field_errors(title: str, problems: list[tuple[Location, str]]) -> ValidationError:
    """One error per (location, message), for checks across fields or models: a plain ValueError
    from a model validator would name no field, and every registry error names one."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("value_error", "{message}", {"message": message}),
                loc=location,
                input=None,
            )
            for location, message in problems
        ],
    )
