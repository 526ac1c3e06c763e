"""Stored responses through the official openai SDK, across a gateway restart.

Two API keys on one gateway whose response store is a SQLite file in the test's folder: a response
stored with `store: true` can be fetched, continued with `previous_response_id` (the new prompt holds
the stored conversation) and deleted by the key that created it, and by no other (a 404, as for a
missing one); all of it still holds after the gateway restarts on the same file.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.harness import GatewayProcess
from tests.integration.conftest import demo_entry, write_registry

OWNER, STRANGER = "responses-owner-key-0123456789", "responses-other-key-0123456789"
ENV = {"GATEWAY_API_KEYS": f"{OWNER},{STRANGER}", "GATEWAY_ADMIN_KEYS": ""}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("stored")
    return write_registry(folder / "models.yaml", [demo_entry("m", demo_model_dir)],
                          responses={"path": "state/responses.sqlite3"})  # fmt: skip


def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def chat_prompt_tokens(gateway: GatewayProcess, messages: list[dict[str, str]]) -> int:
    reply = httpx.post(gateway.url + "/v1/tokenize", json={"model": "m", "messages": messages},
                       headers={"Authorization": f"Bearer {OWNER}"})  # fmt: skip
    return int(reply.json()["count"])


def test_stored_responses_are_kept_per_key_and_across_a_restart(config: Path) -> None:
    ask = "My name is Ada."
    with (
        GatewayProcess(config, env=ENV) as gateway,
        sdk(gateway, OWNER) as owner,
        sdk(gateway, STRANGER) as other,
    ):
        first = owner.responses.create(model="m", input=ask, store=True, max_output_tokens=5, temperature=0)
        assert first.store is True and first.id.startswith("resp_")
        fetched = owner.responses.retrieve(first.id)
        assert fetched.id == first.id and fetched.output_text == first.output_text
        # Continued: the new prompt is the stored conversation, then the new turn.
        second = owner.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                        store=True, max_output_tokens=5, temperature=0)  # fmt: skip
        history = [{"role": "user", "content": ask}, {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "What is my name?"}]  # fmt: skip
        assert second.previous_response_id == first.id
        assert second.usage is not None and second.usage.input_tokens == chat_prompt_tokens(gateway, history)
        # Streamed and stored: fetchable as soon as the stream has ended.
        with owner.responses.stream(model="m", input="Hi", store=True, max_output_tokens=3) as stream:
            events = list(stream)
        streamed_id = events[-1].response.id  # type: ignore[union-attr]
        assert owner.responses.retrieve(streamed_id).output_text == events[-1].response.output_text  # type: ignore[union-attr]
        # Another key sees nothing, exactly as for an id that does not exist.
        for response_id in (first.id, "resp_missing"):
            with pytest.raises(openai.NotFoundError):
                other.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError):
                other.responses.delete(response_id)
            with pytest.raises(openai.BadRequestError) as refused:
                other.responses.create(
                    model="m", input="x", previous_response_id=response_id, max_output_tokens=2
                )
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
        # store: false keeps nothing.
        unstored = owner.responses.create(model="m", input="x", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            owner.responses.retrieve(unstored.id)

    with (
        GatewayProcess(config, env=ENV) as gateway,
        sdk(gateway, OWNER) as owner,
        sdk(gateway, STRANGER) as other,
    ):
        assert owner.responses.retrieve(second.id).output_text == second.output_text
        third = owner.responses.create(model="m", input="And again?", previous_response_id=second.id,
                                       max_output_tokens=3, temperature=0)  # fmt: skip
        history += [
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "And again?"},
        ]
        assert third.usage is not None and third.usage.input_tokens == chat_prompt_tokens(gateway, history)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(second.id)
        owner.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            owner.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError):
            owner.responses.create(model="m", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert (config.parent / "state" / "responses.sqlite3").is_file()
