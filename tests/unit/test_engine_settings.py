"""GPU engines' settings at config time: what exllamav2 (and exllamav3) would refuse at load or at a
job's enqueue is refused when the registry loads, naming the file, the model and the field.

Runs in the pytest process; the registry check runs `model_worker.settings_check` in a subprocess,
as `gateway serve` does. No GPU and no engine library is needed: the settings models import neither.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config.registry import ConfigError, load_registry
from model_worker.engines.exllamav2.settings import ExLlamaV2Settings
from model_worker.engines.exllamav3.settings import ExLlamaV3Settings


def registry(tmp_path: Path, entry: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - {name: m, path: x, gpus: [0], " + entry + "}\n")
    return path


@pytest.mark.parametrize(
    ("entry", "field", "fragment"),
    [
        ("engine_settings: {cache_size: 5000}", "cache_size", "(exllamav2's cache page), e.g. 5120"),
        ("max_seq_len: 8192, engine_settings: {cache_size: 4096}", "cache_size", "needs at least 8192"),
        # A drafting job holds 4 tokens past max_seq_len, which takes one more page.
        ("max_seq_len: 4096, engine_settings: {cache_size: 4096, ngram_draft: true}", "cache_size",
         "(exllamav2 reserves the draft window); it needs at least 4352"),
        ("engine_settings: {max_chunk_size: 1000}", "max_chunk_size", "whole cache pages), e.g. 768"),
        ("engine_settings: {max_chunk_size: 100}", "max_chunk_size", "e.g. 256"),
        ("engine_settings: {cache_size: 100}", "cache_size", "greater than or equal to 256"),
        ("engine_settings: {gpu_split: [0]}", "gpu_split", "at least one GPU a positive number of GB"),
        # pydantic alone reads true as 1 and .inf as a size.
        ("engine_settings: {max_batch_size: true}", "max_batch_size", "true/false is not a value"),
        ("engine_settings: {gpu_split: [true, 20]}", "gpu_split", "true/false is not a value"),
        ("engine_settings: {reserve_vram_gb: .inf}", "reserve_vram_gb", "finite number"),
    ],
)  # fmt: skip
def test_exllamav2_refusals_name_the_field(tmp_path: Path, entry: str, field: str, fragment: str) -> None:
    path = registry(tmp_path, entry)
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert str(path) in message and "model 'm'" in message
    assert f"field 'engine_settings.{field}'" in message, message
    assert fragment in message, message


def test_exllamav2_accepts_what_it_can_run(tmp_path: Path) -> None:
    entries = [
        "max_seq_len: 4096, engine_settings: {cache_size: 4096, max_chunk_size: 512}",
        "max_seq_len: 4096, engine_settings: {cache_size: 4352, ngram_draft: true}",
        # Unpaged, a prefill chunk may be any size (the whole cache is one page).
        "max_seq_len: 2048, engine_settings: {paged: false, max_chunk_size: 100}",
    ]
    for entry in entries:
        model = load_registry(registry(tmp_path, entry)).models[0]
        assert model.engine == "exllamav2"


def test_exllamav2_cache_size_default_and_per_job() -> None:
    settings = ExLlamaV2Settings.model_validate({"max_batch_size": 3}, context={"max_seq_len": 1000})
    assert settings.tokens_per_job(1000) == 1024
    assert settings.paged_cache_size(1000) == 3072  # 3 x 1000, rounded up to whole pages
    drafting = ExLlamaV2Settings.model_validate({"ngram_draft": True, "cache_size": 1280}, context={})
    assert drafting.tokens_per_job(1024) == 1280 and drafting.paged_cache_size(1024) == 1280
    with pytest.raises(ValidationError) as info:
        ExLlamaV2Settings.model_validate({"cache_size": 1024}, context={"max_seq_len": 2000})
    assert info.value.errors()[0]["loc"] == ("cache_size",)


@pytest.mark.parametrize(
    ("settings", "field", "fragment"),
    [
        ("paged: false", "paged", "exllamav2 setting: exllamav3 always batches"),
        ("cache_size: 5000", "cache_size", "(exllamav3's cache page), e.g. 5120"),
        # exllamav3 reserves prompt + completion + 1 token: a full-length job needs one more page.
        ("cache_size: 4096", "cache_size", "reserves one token more); it needs at least 4352"),
        (
            "cache_size: 4352, ngram_draft: true, max_chunk_size: 256",
            "cache_size",
            "and the draft window); it needs at least 4608",
        ),
        ("max_chunk_size: 100", "max_chunk_size", "(exllamav3 prefills whole cache pages), e.g. 256"),
        ("cache_mode: Q7", "cache_mode", "'Q8', 'Q6', 'Q5', 'Q4', 'Q3' or 'Q2'"),
        ("gpu_split: [0]", "gpu_split", "at least one GPU a positive number of GB"),
        ("gpu_split: [10, 10]", "gpu_split", "one entry per GPU"),
        ("use_per_device: [10]", "use_per_device", "Extra inputs are not permitted"),
    ],
)
def test_exllamav3_refusals_name_the_field(tmp_path: Path, settings: str, field: str, fragment: str) -> None:
    max_seq_len = 4350 if "ngram_draft" in settings else 4096  # 4351 tokens fit 17 pages, 4355 do not
    entry = f"engine: exllamav3, max_seq_len: {max_seq_len}, engine_settings: {{{settings}}}"
    path = registry(tmp_path, entry)
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert f"field 'engine_settings.{field}'" in message and fragment in message, message


def test_exllamav3_accepts_what_it_can_run(tmp_path: Path) -> None:
    entry = "engine: exllamav3, max_seq_len: 4096, engine_settings: {cache_size: 4352, cache_mode: Q4}"
    model = load_registry(registry(tmp_path, entry)).models[0]
    assert model.engine == "exllamav3" and model.engine_settings["cache_mode"] == "Q4"
    settings = ExLlamaV3Settings.model_validate({"max_batch_size": 3}, context={"max_seq_len": 1000})
    assert settings.paged_cache_size(1000) == 3072 and settings.cache_bits() is None
    assert ExLlamaV3Settings.model_validate({"cache_mode": "Q6"}).cache_bits() == 6


def test_exllamav3_tensor_parallel_needs_two_gpus_per_replica(tmp_path: Path) -> None:
    one_gpu = registry(tmp_path, "engine: exllamav3, engine_settings: {tensor_parallel: true}")
    with pytest.raises(ConfigError) as info:
        load_registry(one_gpu)
    message = str(info.value)
    assert "field 'engine_settings.tensor_parallel'" in message and "at least two GPUs" in message, message
    two_gpus = tmp_path / "two.yaml"
    two_gpus.write_text(
        "models:\n  - {name: m, path: x, gpus: [0, 1], engine: exllamav3,"
        " engine_settings: {tensor_parallel: true, tp_backend: nccl}}\n"
    )
    model = load_registry(two_gpus).models[0]
    assert model.engine_settings["tensor_parallel"] is True and model.engine_settings["tp_backend"] == "nccl"


def test_exllamav3_tp_backend_alone_is_refused(tmp_path: Path) -> None:
    path = registry(tmp_path, "engine: exllamav3, engine_settings: {tp_backend: nccl}")
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert "field 'engine_settings.tp_backend'" in message and "only with tensor_parallel" in message, message


def test_exllamav3_load_arguments_per_split() -> None:
    from model_worker.engines.exllamav3.loading import load_arguments

    layers = ExLlamaV3Settings.model_validate({"reserve_vram_gb": 2.0})
    assert load_arguments(layers) == {"max_chunk_size": 2048, "max_batch_size": 8, "reserve_per_device": 2.0}
    tensor = ExLlamaV3Settings.model_validate({"tensor_parallel": True, "gpu_split": [20, 20]})
    assert load_arguments(tensor) == {
        "max_chunk_size": 2048,
        "max_batch_size": 8,
        "use_per_device": [20, 20],
        "tensor_p": True,
        "tp_backend": "native",
    }
    # A draft model loads with the layer split: tensor parallelism is for the main model.
    assert "tensor_p" not in load_arguments(tensor, main_model=False)


def test_exllamav3_out_of_memory_on_load_names_the_cache_and_the_split() -> None:
    """The default cache (max_seq_len x max_batch_size) can outweigh the weights: a split that cannot
    hold it must say which settings to change, not only the library's words."""
    from model_worker.engines.exllamav3.loading import insufficient_vram_message

    split = ExLlamaV3Settings.model_validate({"gpu_split": [14.0, 18.0], "max_batch_size": 64})
    message = insufficient_vram_message(split, 262144, "Insufficient VRAM in split for model and cache")
    assert message.startswith("Insufficient VRAM in split for model and cache: "), message
    assert "262144 tokens (max_seq_len x max_batch_size)" in message, message
    assert "gpu_split [14.0, 18.0] GB" in message, message
    assert "engine_settings.cache_size" in message
    sized = ExLlamaV3Settings.model_validate({"cache_size": 32768})
    message = insufficient_vram_message(sized, 32768, "Insufficient VRAM in split for model and cache")
    assert "32768 tokens (cache_size)" in message and "reserve_vram_gb" in message, message


@pytest.mark.parametrize(
    ("entry", "settings_model"),
    [
        ("engine: exllamav3", ExLlamaV3Settings),
        ("engine: exllamav3, engine_settings: {cache_size: 8192, cache_mode: Q4}", ExLlamaV3Settings),
        ("engine: exllamav2", ExLlamaV2Settings),
        ("engine: exllamav2, engine_settings: {cache_mode: Q4}", ExLlamaV2Settings),
    ],
)
def test_the_settings_the_registry_hands_a_worker_validate_again(
    tmp_path: Path, entry: str, settings_model: type
) -> None:
    # The registry check hands each worker its settings with every default filled in; the worker
    # validates them again, so a cross-field rule must hold for its own defaults too.
    model = load_registry(registry(tmp_path, entry)).models[0]
    again = settings_model.model_validate(model.engine_settings, context={"gpu_counts": [1]})
    assert again.model_dump(mode="json") == model.engine_settings
