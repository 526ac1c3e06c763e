"""Stored responses shared by two real gateways through a real Redis, through the openai SDK.

Runs in the pytest process: a redis-server on a free loopback port (tests/redis_server.py) and two
gateways, each with its own CPU worker, that name it in `server.redis_url`. Gateway A keeps the
default `server.responses` (backend auto, so Redis; a long retention); gateway B names the redis
backend with a 3 s retention, so expiry is seen without a long wait. A response stored through A
is fetched and continued through B, deleted through B and gone on A, invisible to another API key;
one stored through B expires. Then Redis stops: requests that store, fetch, continue or delete a
response are a 503 `store_unavailable` with a log line, others go on; Redis starts again and
storing works again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness import GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry
from tests.redis_server import RedisServer

OWNER, STRANGER = "responses-owner-key-0123456789", "responses-other-key-0123456789"
ENV = {"GATEWAY_API_KEYS": f"{OWNER},{STRANGER}", "GATEWAY_ADMIN_KEYS": ""}
SHORT_RETENTION_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("responses-redis")
    redis_server = RedisServer(folder)
    redis_server.start()
    model = [demo_entry("m", demo_model_dir)]
    config_a = write_registry(folder / "a.yaml", model, redis_url=redis_server.url)
    config_b = write_registry(folder / "b.yaml", model, redis_url=redis_server.url,
                              responses={"backend": "redis", "retention_s": SHORT_RETENTION_S})  # fmt: skip
    try:
        with (
            GatewayProcess(config_a, env=ENV, wait_ready=False) as a,
            GatewayProcess(config_b, env=ENV, wait_ready=False) as b,
        ):
            for gateway in (a, b):
                gateway.wait_until_ready(180)
            yield {"redis": redis_server, "a": a, "b": b}
    finally:
        redis_server.stop()


def sdk(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0)


def chat_prompt_tokens(gateway: GatewayProcess, messages: list[dict[str, str]]) -> int:
    reply = httpx.post(gateway.url + "/v1/tokenize", json={"model": "m", "messages": messages},
                       headers={"Authorization": f"Bearer {OWNER}"})  # fmt: skip
    return int(reply.json()["count"])


def gone(client: openai.OpenAI, response_id: str) -> bool:
    try:
        client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return True
    return False


def test_a_response_stored_on_one_gateway_is_fetched_continued_and_deleted_on_the_other(
    cluster: dict[str, Any],
) -> None:
    a, b = cluster["a"], cluster["b"]
    with sdk(a, OWNER) as owner_a, sdk(b, OWNER) as owner_b, sdk(b, STRANGER) as other_b:
        ask = "My name is Ada."
        first = owner_a.responses.create(model="m", input=ask, store=True, max_output_tokens=5, temperature=0)
        fetched = owner_b.responses.retrieve(first.id)
        assert fetched.id == first.id and fetched.output_text == first.output_text
        # Continued through B: its prompt is the conversation A stored, then the new turn.
        second = owner_b.responses.create(model="m", input="What is my name?", previous_response_id=first.id,
                                          max_output_tokens=3, temperature=0)  # fmt: skip
        history = [{"role": "user", "content": ask}, {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "What is my name?"}]  # fmt: skip
        assert second.previous_response_id == first.id
        assert second.usage is not None and second.usage.input_tokens == chat_prompt_tokens(b, history)
        # Another key sees nothing, exactly as for an id that does not exist.
        for response_id in (first.id, "resp_missing"):
            with pytest.raises(openai.NotFoundError):
                other_b.responses.retrieve(response_id)
            with pytest.raises(openai.NotFoundError):
                other_b.responses.delete(response_id)
            with pytest.raises(openai.BadRequestError) as refused:
                other_b.responses.create(
                    model="m", input="x", previous_response_id=response_id, max_output_tokens=2
                )
            assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
        assert owner_a.responses.retrieve(first.id).id == first.id  # the stranger deleted nothing
        # Deleted through B: gone on A, and no longer continued there.
        owner_b.responses.delete(first.id)
        assert gone(owner_a, first.id)
        with pytest.raises(openai.BadRequestError):
            owner_a.responses.create(model="m", input="x", previous_response_id=first.id, max_output_tokens=2)


def test_a_response_expires_after_the_retention_of_the_gateway_storing_it(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    with sdk(a, OWNER) as owner_a, sdk(b, OWNER) as owner_b:
        kept = owner_a.responses.create(model="m", input="Keep me", store=True, max_output_tokens=2)
        brief = owner_b.responses.create(model="m", input="Forget me", store=True, max_output_tokens=2)
        assert owner_a.responses.retrieve(brief.id).id == brief.id
        wait_until(lambda: gone(owner_a, brief.id), f"the response to expire after {SHORT_RETENTION_S:g} s")
        assert owner_b.responses.retrieve(kept.id).id == kept.id  # A's retention is 30 days


def test_without_redis_storage_requests_are_a_503_and_others_go_on(cluster: dict[str, Any]) -> None:
    a, b = cluster["a"], cluster["b"]
    redis_server: RedisServer = cluster["redis"]
    with sdk(a, OWNER) as owner_a, sdk(b, OWNER) as owner_b:
        stored = owner_a.responses.create(model="m", input="Hi", store=True, max_output_tokens=2)
        redis_server.stop()
        try:
            refusals = [
                lambda: owner_a.responses.create(model="m", input="Hi", store=True, max_output_tokens=2),
                lambda: owner_a.responses.create(
                    model="m", input="Hi", store=True, stream=True, max_output_tokens=2
                ),
                lambda: owner_b.responses.create(
                    model="m", input="Hi", previous_response_id=stored.id, max_output_tokens=2
                ),
                lambda: owner_b.responses.retrieve(stored.id),
                lambda: owner_b.responses.delete(stored.id),
            ]
            for refused_call in refusals:
                with pytest.raises(openai.InternalServerError) as refused:
                    refused_call()
                assert refused.value.status_code == 503
                assert refused.value.body["code"] == "store_unavailable"  # type: ignore[index]
            # Nothing that leaves the store alone is touched.
            unstored = owner_a.responses.create(model="m", input="Hi", max_output_tokens=2)
            assert unstored.status in ("completed", "incomplete")  # incomplete: max_output_tokens
            chat = owner_b.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
            assert chat.choices[0].message.content is not None
            for log in (a.log(), b.log()):
                assert "Redis unreachable (ConnectionError): stored responses are unavailable" in log
                assert "the response store is unavailable" in log and "Traceback" not in log
        finally:
            redis_server.start()
        # Redis is back (empty: it keeps nothing on disk here): storing works again.
        again = wait_until(
            lambda: owner_a.responses.create(model="m", input="Hi", store=True, max_output_tokens=2),
            "storing to work again",
            retry_on=(openai.InternalServerError,),
        )
        assert owner_b.responses.retrieve(again.id).id == again.id
        assert "Redis reachable again: stored responses are available again" in a.log()
