"""The exllama engines' codec as the worker's prompt threads share it: encodes of long texts take
turns (exllamav3 switches TOKENIZERS_PARALLELISM in os.environ around them), short ones do not wait
for a long one. A stand-in tokenizer records how many encodes run at once."""

from __future__ import annotations

import threading
from typing import Any

import torch

from model_worker.engines.dynamic_generator import LONG_TEXT_CHARS, LibraryCodec


class OverlapTokenizer:
    """Each encode waits at a barrier for a second one: if two get there at once, they overlapped."""

    def __init__(self, wait_s: float) -> None:
        self.barrier = threading.Barrier(2, timeout=wait_s)
        self.overlapped = 0
        self.lock = threading.Lock()

    def encode(self, text: str, **_: Any) -> torch.Tensor:
        try:
            self.barrier.wait()
            with self.lock:
                self.overlapped += 1
        except threading.BrokenBarrierError:
            pass  # alone: the other encode waited for this one to end
        return torch.tensor([[len(text)]])


def encode_two_at_once(codec: LibraryCodec, first: str, second: str) -> list[list[int]]:
    results: list[list[int]] = [[], []]

    def run(index: int, text: str) -> None:
        results[index] = codec.encode(text, add_special_tokens=False)

    threads = [threading.Thread(target=run, args=pair) for pair in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return results


def test_two_long_texts_take_turns_on_the_shared_codec() -> None:
    tokenizer = OverlapTokenizer(wait_s=1.0)  # each waits this long for the other, which never comes
    codec = LibraryCodec(tokenizer, torch, serial_long_texts=True)
    long_text = "x" * LONG_TEXT_CHARS
    assert encode_two_at_once(codec, long_text, long_text) == [[LONG_TEXT_CHARS], [LONG_TEXT_CHARS]]
    assert tokenizer.overlapped == 0


def test_a_short_text_encodes_beside_a_long_one() -> None:
    tokenizer = OverlapTokenizer(wait_s=30.0)  # met at once when they overlap; long, for a slow machine
    codec = LibraryCodec(tokenizer, torch, serial_long_texts=True)
    encode_two_at_once(codec, "x" * LONG_TEXT_CHARS, "short")
    assert tokenizer.overlapped == 2
