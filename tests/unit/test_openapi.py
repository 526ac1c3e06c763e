"""The OpenAPI description is generated from the routes themselves: every route is in it (so the
fuzz test reaches every route), with the request schemas the routes validate with."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from gateway.config.registry import parse_registry
from gateway.http.app import create_app

# Served by quart-schema itself.
NOT_API = {"/openapi.json", "/docs"}


def test_every_route_is_described_with_its_schema(tmp_path: Path) -> None:
    raw = {"server": {"runtime_dir": str(tmp_path / "rt")},
           "models": [{"name": "m", "engine": "transformers", "path": str(tmp_path)}]}  # fmt: skip
    app = create_app(parse_registry(raw, tmp_path / "models.yaml"))
    routes = {re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule) for rule in app.url_map.iter_rules()}

    async def fetch() -> tuple[dict[str, object], int, str]:
        client = app.test_client()
        description = await (await client.get("/openapi.json")).get_json()
        docs = await client.get("/docs")
        await app.extensions["gateway"].link.close()  # the app's socket exists from its creation
        return description, docs.status_code, (await docs.get_data(as_text=True))

    description, docs_status, docs_page = asyncio.run(fetch())
    paths = description["paths"]
    assert isinstance(paths, dict)
    assert set(paths) == routes - NOT_API
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "messages" in chat["properties"] and "messages" in chat["required"]
    assert "requestBody" in paths["/tokenize"]["post"]
    assert docs_status == 200 and "/openapi.json" in docs_page
