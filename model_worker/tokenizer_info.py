"""What a worker tells clients about its tokenizer (vLLM's /tokenizer_info, which lm-eval reads).

Runs in the worker process at load time. Owns reading the model folder's tokenizer_config.json
into the wire's `TokenizerInfo`; the chat template is the one the worker renders with (the
registry's override if there is one), and the length is the context the model is served with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from model_worker.chat_template import ChatTemplate
from wire.stats import TokenizerInfo


def _token(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_info(model_dir: str, max_seq_len: int, chat_template: ChatTemplate | None) -> TokenizerInfo:
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    return TokenizerInfo(
        tokenizer_class=str(config.get("tokenizer_class") or ""),
        bos_token=_token(config.get("bos_token")),
        eos_token=_token(config.get("eos_token")),
        pad_token=_token(config.get("pad_token")),
        unk_token=_token(config.get("unk_token")),
        chat_template=chat_template.source if chat_template is not None else None,
        model_max_length=max_seq_len,
    )
