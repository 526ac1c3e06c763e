"""Registry loading: valid files load; each kind of mistake names the file, the model and the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config.registry import ConfigError, load_registry, worker_spec
from tests.harness import REPO_ROOT
from wire.params import WorkerSpec


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


GOOD = """
server: {port: 9000}
models:
  - name: alpha
    engine: transformers
    path: models/alpha
    max_seq_len: 1024
    aliases: [a]
    defaults: {temperature: 0.2}
  - name: beta
    path: /abs/beta
    gpus: [0, 1]
    engine_settings: {gpu_split: [20, 24], cache_mode: Q4, draft_path: drafts/small}
"""


def test_valid_registry_resolves_relative_paths(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, GOOD))
    alpha = registry.model("a")
    assert alpha is not None and alpha.name == "alpha"
    assert alpha.path == (tmp_path / "models/alpha").resolve()
    assert alpha.defaults.temperature == 0.2
    beta = registry.model("beta")
    assert beta is not None and beta.engine == "exllamav2" and beta.gpus == [0, 1]
    assert registry.server.port == 9000
    # The engine's own settings model filled in its defaults and resolved its paths.
    assert beta.engine_settings["cache_mode"] == "Q4" and beta.engine_settings["max_batch_size"] == 8
    assert beta.engine_settings["draft_path"] == str((tmp_path / "drafts/small").resolve())
    assert beta.weight_dirs == (Path("/abs/beta"), (tmp_path / "drafts/small").resolve())
    assert alpha.engine_settings == {
        "max_batch_size": 8,
        "max_chunk_size": 2048,
        "dtype": "auto",
        "threads": None,
    }


def test_shipped_registry_is_valid() -> None:
    registry = load_registry(REPO_ROOT / "config" / "models.yaml")
    names = [m.name for m in registry.models]
    assert names == ["smollm2-135m-instruct", "demo-small", "demo-medium", "demo-embed"]
    assert all(m.engine == "transformers" and m.gpus == [] for m in registry.models)
    assert [m.task for m in registry.models] == ["generate", "generate", "generate", "embed"]
    assert [m.tool_call_parser for m in registry.models] == [None, "hermes", "hermes", None]
    # The tools template its comment (and the README) names is there.
    assert (REPO_ROOT / "config" / "templates" / "smollm2-tools.jinja").is_file()


@pytest.mark.parametrize(
    "path", sorted((REPO_ROOT / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_example_registries_are_valid(path: Path) -> None:
    assert load_registry(path).models


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        (
            "  - {name: m1, engine: transformers, path: x, max_seq_len: -5}",
            ["model 'm1'", "field 'max_seq_len'"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x, colour: blue}",
            ["model 'm1'", "field 'colour'", "Extra"],
        ),
        ("  - {name: m1, engine: vllm, path: x}", ["model 'm1'", "field 'engine'"]),
        ("  - {name: m1, path: x}", ["model 'm1'", "needs at least one GPU"]),
        (
            "  - {name: m1, engine: transformers, path: x, defaults: {temperature: 9}}",
            ["field 'defaults.temperature'"],
        ),
        ("  - {engine: transformers, path: x}", ["model #1", "field 'name'"]),
        (
            "  - {name: m1, path: x, gpus: [0], engine_settings: {gpu_split: [1, 2]}}",
            ["model 'm1'", "field 'engine_settings.gpu_split'", "one entry per GPU"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x, engine_settings: {cache_mode: Q4}}",
            ["model 'm1'", "field 'engine_settings.cache_mode'", "Extra"],
        ),
        (
            "  - {name: m1, path: x, gpus: [0], engine_settings: {ngram_draft: true, draft_path: d}}",
            ["model 'm1'", "field 'engine_settings'", "choose one"],
        ),
        (
            "  - {name: m1, path: x, gpus: [0], engine_settings: {cache_mode: Q3}}",
            ["model 'm1'", "field 'engine_settings.cache_mode'"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x}\n"
            "  - {name: m2, engine: transformers, path: y, aliases: [m1]}",
            ["model 'm2', field 'aliases.0': 'm1' already names model #1 ('m1')"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x, limits: {admission_window_ms: 500}}",
            ["model 'm1'", "field 'limits.admission_window_ms'", "100"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x, reasoning_parser: o1}",
            ["model 'm1'", "field 'reasoning_parser'", "'deepseek_r1' or 'qwen3'"],
        ),
        (
            "  - {name: m1, engine: transformers, path: x, fallbacks: [m2, nope]}\n"
            "  - {name: m2, engine: transformers, path: y, task: embed, fallbacks: [m2]}",
            [
                "model 'm1', field 'fallbacks': 'nope' is not a model",
                "model 'm1', field 'fallbacks': 'm2' has task embed, this model has task generate",
                "model 'm2', field 'fallbacks': fallbacks apply to generate models; this model has task "
                "embed",
            ],
        ),
    ],
)
def test_errors_name_file_model_and_field(tmp_path: Path, snippet: str, expected: list[str]) -> None:
    path = write(tmp_path, "models:\n" + snippet + "\n")
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in expected:
        assert fragment in message


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_registry(write(tmp_path, "models:\n  - name: [unclosed\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_registry(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("value", "expected"), [("", 300.0), ("retry_failed_after_s: 5", 5.0),
                                                  ("retry_failed_after_s: 0", 0.0),
                                                  ("retry_failed_after_s: null", None)])  # fmt: skip
def test_retry_of_failed_workers_is_on_by_default_and_can_be_turned_off(
    tmp_path: Path, value: str, expected: float | None
) -> None:
    text = f"server: {{{value}}}\nmodels:\n  - {{name: m1, engine: transformers, path: x}}\n"
    assert load_registry(write(tmp_path, text)).server.retry_failed_after_s == expected


def test_negative_retry_of_failed_workers_is_refused(tmp_path: Path) -> None:
    text = "server: {retry_failed_after_s: -1}\nmodels:\n  - {name: m1, engine: transformers, path: x}\n"
    with pytest.raises(ConfigError, match="retry_failed_after_s"):
        load_registry(write(tmp_path, text))


def test_registry_is_frozen(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, GOOD))
    with pytest.raises(Exception, match="frozen"):
        registry.models[0].max_seq_len = 5  # type: ignore[misc]


def test_check_config_cli_reports_cleanly(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "models:\n  - {name: broken, engine: transformers, path: x, engine_settings: {max_batch_size: 0}}\n",
    )
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "model 'broken'" in result.stderr and "field 'engine_settings.max_batch_size'" in result.stderr
    assert str(bad) in result.stderr
    assert "Traceback" not in result.stderr + result.stdout

    # The shipped demo registry, validated for a host where `make serve` has made its models.
    good = subprocess.run(
        [
            sys.executable,
            "-m",
            "gateway",
            "check-config",
            str(REPO_ROOT / "config/models.yaml"),
            "--allow-missing",
        ],  # noqa: E501
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert good.returncode == 0, good.stderr
    assert "ok: demo-small" in good.stdout


def check_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "check-config", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )


def test_check_config_fails_on_what_this_host_lacks(tmp_path: Path) -> None:
    (tmp_path / "here").mkdir()
    entry = "{name: %s, engine: transformers, path: %s}"
    models = f"  - {entry % ('present', 'here')}\n  - {entry % ('absent', 'gone')}\n"
    config = write(tmp_path, "models:\n" + models)
    missing = check_config(str(config))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert f"{config}: model 'absent', field 'path': {tmp_path / 'gone'} is not a folder" in missing.stderr
    assert "'present'" not in missing.stderr and "--allow-missing" in missing.stderr
    allowed = check_config(str(config), "--allow-missing")
    assert allowed.returncode == 0 and "not checked on this host (--allow-missing)" in allowed.stdout
    # GPU indices this host does not have (this test host has no GPU at all, or fewer than 64).
    gpus = write(tmp_path, "models:\n  - {name: big, path: here, gpus: [63]}\n")
    refused = check_config(str(gpus))
    assert refused.returncode == 2 and "model 'big': gpus [63]" in refused.stderr
    assert "GPU 63 does not exist" in refused.stderr
    assert check_config(str(gpus), "--allow-missing").returncode == 0


def test_env_and_variables(tmp_path: Path) -> None:
    text = (
        "models:\n  - name: m\n    engine: transformers\n    path: ${MODEL_ROOT}/m\n"
        "    env: {OMP_NUM_THREADS: '${THREADS:-2}', GREETING: 'cost $$5'}\n"
    )
    registry = load_registry(write(tmp_path, text), environ={"MODEL_ROOT": "/srv/models"})
    model = registry.models[0]
    assert model.path == Path("/srv/models/m")
    assert model.env == {"OMP_NUM_THREADS": "2", "GREETING": "cost $5"}
    assert worker_spec(model, 1.0).env == model.env
    with pytest.raises(ConfigError, match=r"model 'm', field 'path': \$\{MODEL_ROOT\} is not set"):
        load_registry(write(tmp_path, text), environ={})
    with pytest.raises(ConfigError, match="model 'm', field 'env': CUDA_VISIBLE_DEVICES is set by"):
        load_registry(write(tmp_path, "models:\n  - {name: m, path: x, env: {CUDA_VISIBLE_DEVICES: '1'}}\n"))


def test_exclusive_groups_start_one_model(tmp_path: Path) -> None:
    entry = "  - {name: %s, path: x, gpus: [0], exclusive_group: g}\n"
    two = "models:\n" + entry % "a" + entry % "b"
    with pytest.raises(ConfigError, match=r"exclusive_group 'g': models \['a', 'b'\] are all `load: st"):
        load_registry(write(tmp_path, two))
    fine = load_registry(write(tmp_path, two.replace("{name: b", "{load: on_demand, name: b")))
    assert [m.exclusive_group for m in fine.models] == ["g", "g"]


def test_hub_paths(tmp_path: Path) -> None:
    text = "server: {model_cache_dir: cache}\nmodels:\n  - {name: q, engine: transformers, path: 'hf://Org/Model-1@v2'}\n"
    model = load_registry(write(tmp_path, text)).models[0]
    assert str(model.hub) == "hf://Org/Model-1@v2" and model.path == tmp_path / "cache/Org--Model-1/v2"
    with pytest.raises(ConfigError, match=r"model 'q', field 'path': 'hf://nope' is not hf://ORG/NAME"):
        load_registry(write(tmp_path, text.replace("Org/Model-1@v2", "nope")))


def test_remote_model_needs_a_listener(tmp_path: Path) -> None:
    match = r"model 'r', field 'remote': a remote model needs server.remote_workers or server.cluster"
    with pytest.raises(ConfigError, match=match):
        load_registry(
            write(tmp_path, "models:\n  - {name: r, engine: transformers, path: x, remote: true}\n")
        )
    text = (
        "server:\n  remote_workers: {bind: 'tcp://0.0.0.0:5555', secret_key_file: k/gw.key_secret,"
        " authorized_keys_dir: k/ok}\n"
        "models:\n  - {name: r, engine: transformers, path: x, remote: true}\n"
    )
    registry = load_registry(write(tmp_path, text))
    remote = registry.server.remote_workers
    assert remote is not None and remote.authorized_keys_dir == (tmp_path / "k/ok").resolve()
    with pytest.raises(ConfigError, match="field 'server.remote_workers.bind'|remote_workers"):
        load_registry(write(tmp_path, text.replace("tcp://0.0.0.0:5555", "ipc:///x")))


def test_replica_gpus_must_match_replicas(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replica_gpus needs one GPU list per replica"):
        load_registry(
            write(tmp_path, "models:\n  - {name: m, path: x, gpus: [0], replicas: 2, replica_gpus: [[0]]}\n")
        )
    registry = load_registry(
        write(tmp_path, "models:\n  - {name: m, path: x, replicas: 2, replica_gpus: [[0], [1]]}\n")
    )
    assert [registry.models[0].gpus_of_replica(r) for r in range(2)] == [[0], [1]]


def _spawned_and_remote(tmp_path: Path, entry: str) -> tuple[WorkerSpec, Path]:
    """The spec a gateway gives a spawned worker for this one-model entry, and the same entry as a
    remote model's file (what a remote worker reads)."""
    (tmp_path / "x").mkdir(exist_ok=True)
    spawned = worker_spec(load_registry(write(tmp_path, "models:\n" + entry)).models[0], 1.0)
    return spawned, write(tmp_path, "models:\n" + entry.replace("path: x", "path: x, remote: true", 1))


def test_the_admission_window_reaches_spawned_and_remote_workers_alike(tmp_path: Path) -> None:
    from model_worker.remote_spec import RemoteSpecError, remote_spec

    entry = "  - {name: m1, engine: transformers, path: x, limits: {admission_window_ms: 8}}\n"
    spawned, remote = _spawned_and_remote(tmp_path, entry)
    assert spawned.admission_window_s == remote_spec(remote, "m1").admission_window_s == 0.008
    remote.write_text(remote.read_text().replace("8}", "'soon'}"))
    with pytest.raises(RemoteSpecError, match=r"model 'm1', field 'limits.admission_window_ms'"):
        remote_spec(remote, "m1")


def test_the_burst_gather_reaches_spawned_and_remote_workers_alike(tmp_path: Path) -> None:
    from model_worker.remote_spec import RemoteSpecError, remote_spec

    spawned, remote = _spawned_and_remote(tmp_path, "  - {name: m1, engine: transformers, path: x}\n")
    assert spawned.burst_gather_s == remote_spec(remote, "m1").burst_gather_s == 0.04  # on by default
    entry = "  - {name: m1, engine: transformers, path: x, limits: {burst_gather_ms: 0}}\n"
    spawned, remote = _spawned_and_remote(tmp_path, entry)
    assert spawned.burst_gather_s == remote_spec(remote, "m1").burst_gather_s == 0.0
    remote.write_text(remote.read_text().replace("0}", "2000}"))
    with pytest.raises(RemoteSpecError, match=r"model 'm1', field 'limits.burst_gather_ms'.*1000"):
        remote_spec(remote, "m1")
