"""Chat parameters that would change the output and that nothing here honours are refused by name.

Runs in the pytest process, on the request schema alone (the HTTP layer renders the same error as a
400 in OpenAI's shape).
"""

from __future__ import annotations

from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.http.schemas import ChatCompletionRequest

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("reasoning_effort", "low"),
        ("verbosity", "high"),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("modalities", ["text", "audio"]),
    ],
)
def test_an_output_changing_parameter_nothing_honours_is_a_400_naming_it(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        ChatCompletionRequest.model_validate({**BASE, field: value})
    assert refused.value.param == field and refused.value.status == 400


def test_text_modalities_and_unknown_vendor_fields_pass() -> None:
    request = ChatCompletionRequest.model_validate({**BASE, "modalities": ["text"], "x_vendor_flag": 1})
    assert request.model == "m"
