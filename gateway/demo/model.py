"""Offline demo models: a random-weight Llama with a freshly trained byte-level BPE tokenizer.

Runs in the gateway's CLI process (`gateway make-demo-model DIR`) and in test fixtures; never in the
serving path. Owns the presets and the writing of a complete Hugging Face model folder (config,
weights, generation config, tokenizer, chat template) without any network access, so CI, dev
hosts and GPU benchmarks get a loadable model in seconds. The weights are random but scaled so that
greedy output varies with context instead of repeating one token. The tokenizer covers the model's
whole vocabulary: ids past what the BPE learnt from the corpus decode to words such as " w5000", so
every id a model samples is visible text (streams can then be timed by their text chunks too).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
TOKENIZER_VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS_TOKEN = "<s>"
EOS_TOKEN = "<|im_end|>"
# ChatML with Hermes-style tools (as Qwen 2.5 writes them): a system turn lists the tools, calls are
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>` and results come back in `tool` turns.
# Without tools it renders plain ChatML; chat_template_kwargs {"enable_thinking": false} adds an
# empty think block after the generation prompt, as Qwen 3's template does. It starts with the BOS
# token because apply_chat_template tokenizes without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools is defined and tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ 'You may call functions. Their signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nFor each call, answer with a JSON object of the function name and arguments '"
    " + 'within <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, '"
    " + '\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools is defined and tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '\\n<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, dtype="float32"),
    "medium": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, dtype="float32"),
    "tiny-gpu": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=512, dtype="float16"),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, dtype="float16"),
    "llama3-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, dtype="float16"),
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, dtype="float16"),
}  # fmt: skip
_CONFIG_KEYS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "rope_theta", "rms_norm_eps", "dtype",
}  # fmt: skip
_DTYPES = ("float32", "float16", "bfloat16")
_SHARD_BYTES = 2 * 1024**3


def make_demo_model(
    out_dir: Path,
    *,
    preset: str = "small",
    seed: int = 0,
    device: str = "cpu",
    dtype: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a loadable LlamaForCausalLM folder to out_dir and return it.

    overrides replace preset fields (hidden_size, num_hidden_layers, vocab_size, ...). The same
    preset, seed and device always give the same weights and tokenizer.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = set(overrides) - _CONFIG_KEYS
    if unknown:
        raise ValueError(f"unknown demo model settings {sorted(unknown)}; allowed: {sorted(_CONFIG_KEYS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    token_count = tokenizer.get_vocab_size()
    cfg: dict[str, Any] = {"max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
    cfg.update(PRESETS[preset])
    cfg.setdefault("vocab_size", 64 * math.ceil(token_count / 64))
    cfg.update(overrides)
    if dtype is not None:
        cfg["dtype"] = dtype
    _check_shape(cfg, token_count)

    quiet_ids = _unreadable_ids(tokenizer)
    tokenizer = _pad_vocabulary(tokenizer, cfg["vocab_size"])
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(cfg))
    _write_json(out_dir / "config.json", _model_config(cfg, ids))
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[EOS_TOKEN], ids["</s>"]]},
    )
    _write_weights(out_dir, cfg, quiet_ids, seed, device)
    logger.info("wrote demo model %s (preset %s, seed %d) to %s", cfg["dtype"], preset, seed, out_dir)
    return out_dir


def _check_shape(cfg: dict[str, Any], token_count: int) -> None:
    if cfg["dtype"] not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {cfg['dtype']!r}")
    if cfg["intermediate_size"] % 128:
        raise ValueError(f"intermediate_size must be a multiple of 128, not {cfg['intermediate_size']}")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ValueError("hidden_size must be a multiple of num_attention_heads")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg["vocab_size"] < token_count:
        raise ValueError(f"vocab_size must be at least the tokenizer's {token_count} tokens")


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Llama-style: a plain encode with special tokens starts with BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def _pad_vocabulary(tokenizer: Any, vocab_size: int) -> Any:
    """The tokenizer with plain vocabulary entries (" w1000", " w1001", ...) up to vocab_size.

    A BPE trained on a page of text stops far short of a 128k vocabulary; without these entries most
    ids a random model samples would decode to nothing. They are vocabulary entries, not added
    tokens: no merge produces them, so encoding is unchanged, and tokenizers that split on added
    tokens (exllamav2's) are not slowed by a hundred thousand of them.
    """
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    first = tokenizer.get_vocab_size()
    for token_id in range(first, vocab_size):
        vocab[f"\u0120w{token_id}"] = token_id  # \u0120 is the byte-level alphabet's space
    return Tokenizer.from_str(json.dumps(data))


def _tokenizer_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        # The generic class loads tokenizer.json as written; a Llama class would rebuild its own pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": "</s>",
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _model_config(cfg: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids["</s>"],
        "dtype": cfg["dtype"],
        "use_cache": True,
    }


def _weight_shapes(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_out, hidden)),
            (p + "self_attn.k_proj.weight", (kv_out, hidden)),
            (p + "self_attn.v_proj.weight", (kv_out, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_out)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return shapes


def _unreadable_ids(tokenizer: Any) -> list[int]:
    """Token ids whose text alone is a fragment of a UTF-8 character or a control character."""
    ids = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text or any(ord(c) < 32 and c != "\n" for c in text):
            ids.append(token_id)
    return ids


def _write_weights(out_dir: Path, cfg: dict[str, Any], quiet_ids: list[int], seed: int, device: str) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, cfg["dtype"])
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = cfg["hidden_size"]
    residual_scale = math.sqrt(2.0 / cfg["num_hidden_layers"])
    shards = _plan_shards(_weight_shapes(cfg), dtype.itemsize)
    for stale in out_dir.glob("model*.safetensors*"):
        stale.unlink()

    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, shard_shapes in enumerate(shards, start=1):
        file_name = "model.safetensors"
        if len(shards) > 1:
            file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard_shapes:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape, dtype=dtype, device=device)
            else:
                tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
                if name == "model.embed_tokens.weight":
                    tensor.mul_(0.5)
                elif name == "lm_head.weight":
                    # Logits of std ~4 at any width: peaked enough for varied greedy text, not one token.
                    tensor.mul_(4.0 / math.sqrt(hidden))
                    # Byte fragments and control characters get logit 0, far below the best
                    # token's, so greedy text is readable.
                    tensor[torch.tensor(quiet_ids, dtype=torch.long, device=device)] = 0.0
                else:
                    # fan-in scaling keeps every layer's contribution O(1), so context changes the output.
                    tensor.mul_(1.0 / math.sqrt(shape[1]))
                    if name.endswith(("o_proj.weight", "down_proj.weight")):
                        # GPT-2 style: residual branches shrink with depth so that a 32-layer stack
                        # does not drown the token embeddings (deep random models loop on one token).
                        tensor.mul_(residual_scale)
                tensor = tensor.to(dtype)
            tensors[name] = tensor.to("cpu")
            weight_map[name] = file_name
            total_bytes += tensor.numel() * dtype.itemsize
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
        )


def _plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], itemsize: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group tensors into files of about _SHARD_BYTES, so the host never holds an 8B model twice."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
