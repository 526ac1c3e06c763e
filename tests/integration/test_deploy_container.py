"""The CPU image, built from deploy/Dockerfile and started with deploy/compose.yaml as shipped,
serves a demo request (marked slow: it builds an image; run with `pytest -m slow`).

Runs in the pytest process and drives a Docker daemon: it skips, saying why, where none runs.
Base image: $LLM_GATEWAY_TEST_BASE_IMAGE when set (a local image with python3 and venv, for hosts
that cannot pull from a registry), else the Dockerfile's default. Python packages come from the
wheelhouse deploy/wheels/ when it holds torch (offline build), else from the package indexes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import httpx
import pytest

from tests.harness import REPO_ROOT, free_port, wait_until

pytestmark = pytest.mark.slow
DEPLOY = REPO_ROOT / "deploy"
IMAGE = "llm-gateway:cpu"


def compose_command() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return ["docker", "compose"] if probe.returncode == 0 else None


def test_the_cpu_image_serves_a_request_from_compose() -> None:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        pytest.skip("no Docker daemon runs here")
    compose = compose_command()
    if compose is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    build = ["docker", "build", "-f", "deploy/Dockerfile", "--target", "cpu", "-t", IMAGE]
    base = os.environ.get("LLM_GATEWAY_TEST_BASE_IMAGE")
    if base:
        build += ["--build-arg", f"CPU_BASE={base}"]
    if any(p.name.startswith("torch-") for p in (DEPLOY / "wheels").glob("*.whl")):
        build += ["--build-arg", "PIP_OFFLINE=1"]
    built = subprocess.run([*build, "."], cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]

    user = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config}}", IMAGE], capture_output=True, text=True
    )
    config = json.loads(user.stdout)
    assert config["User"] == "1000:1000" and "/health/ready" in " ".join(config["Healthcheck"]["Test"])

    port = free_port()
    project = f"llmgw{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PORT": str(port)}
    up = [*compose, "-f", "compose.yaml", "-p", project]
    try:
        started = subprocess.run(
            [*up, "up", "-d", "--no-build"], cwd=DEPLOY, env=env, capture_output=True, text=True, timeout=600
        )
        assert started.returncode == 0, started.stderr
        url = f"http://127.0.0.1:{port}"

        def compose_logs() -> str:
            return subprocess.run([*up, "logs"], cwd=DEPLOY, capture_output=True, text=True).stdout

        wait_until(
            lambda: httpx.get(url + "/health/ready", timeout=2).status_code == 200,
            "the container's gateway to be ready",
            300,
            context=compose_logs,
            retry_on=(httpx.HTTPError,),
        )
        body = {"model": "demo-small", "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 8
        # The container's own health check (the image's HEALTHCHECK) turns healthy.
        ids = subprocess.run(
            [*up, "ps", "-q", "gateway"], cwd=DEPLOY, capture_output=True, text=True
        ).stdout.split()

        def health() -> str:
            inspect = ["docker", "inspect", "--format", "{{.State.Health.Status}}", ids[0]]
            return subprocess.run(inspect, capture_output=True, text=True).stdout.strip()

        wait_until(lambda: health() == "healthy", "the container's health check to pass", context=health)
    finally:
        subprocess.run(
            [*up, "down", "-v", "--timeout", "30"], cwd=DEPLOY, env=env, capture_output=True, timeout=300
        )
