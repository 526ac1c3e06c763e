"""encode/decode over one transformers tokenizer, and a copy of it for another thread.

Imported in the worker process by the transformers engines. A fast tokenizer changes its Rust
state (truncation, padding) inside calls and raises "Already borrowed" when two threads meet
there, so the prompt thread gets a deep copy of its own instead of sharing the engine's.
"""

from __future__ import annotations

import copy
from typing import Any


class TokenizerCodec:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def copy(self) -> TokenizerCodec:
        """A codec with a tokenizer of its own (the same files and settings), for another thread."""
        return TokenizerCodec(copy.deepcopy(self.tokenizer))
