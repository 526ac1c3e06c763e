"""The exllama engines' prompt-thread tokenizer: the same ids as the library's, the GIL let go.

Runs in the pytest process with the demo model's real `tokenizers.Tokenizer`, held the way each
exllama library holds it (exllama itself needs a GPU, so its wrapper classes are stood in for by
plain holders with the same attribute names).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tokenizers import Tokenizer

from model_worker.engines.prompt_tokenizer import ReleasingTokenizer, releasing_copy

TEXT = "Hello there, <|im_start|> how are you? Ça va. 東京 " * 50


def test_encodes_the_same_as_the_tokenizer_it_wraps(demo_model_dir: Path) -> None:
    inner = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    wrapped = ReleasingTokenizer(inner)
    for special in (True, False):
        assert (
            wrapped.encode(TEXT, add_special_tokens=special).ids
            == inner.encode(TEXT, add_special_tokens=special).ids
        )
    assert wrapped.get_vocab_size() == inner.get_vocab_size()  # everything else passes through


def test_the_copy_wraps_where_each_library_keeps_its_tokenizer(demo_model_dir: Path) -> None:
    inner = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    v3 = SimpleNamespace(tokenizer=inner, name="exllamav3")
    v2 = SimpleNamespace(tokenizer_model=SimpleNamespace(hf_tokenizer=inner), name="exllamav2")
    v3_copy, v2_copy = releasing_copy(v3), releasing_copy(v2)
    assert isinstance(v3_copy.tokenizer, ReleasingTokenizer) and v3_copy.name == "exllamav3"
    assert isinstance(v2_copy.tokenizer_model.hf_tokenizer, ReleasingTokenizer)
    # The engine's own tokenizer is left as it was.
    assert v3.tokenizer is inner and v2.tokenizer_model.hf_tokenizer is inner
    sentencepiece = SimpleNamespace(tokenizer_model=SimpleNamespace(spm=object()))
    assert releasing_copy(sentencepiece) is sentencepiece  # nothing to wrap: shared as it is


def test_another_thread_runs_python_while_it_encodes(demo_model_dir: Path) -> None:
    inner = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    text = TEXT * 200  # long enough that the encode takes a while
    wrapped = ReleasingTokenizer(inner)

    def python_turns_during(encode: object) -> int:
        """How many times a pure-Python loop gets to run while another thread encodes."""
        done = threading.Event()
        worker = threading.Thread(target=lambda: (encode(text), done.set()))  # type: ignore[operator]
        turns = 0
        worker.start()
        while not done.is_set():
            turns += 1
            time.sleep(0)
        worker.join()
        return turns

    holding = python_turns_during(inner.encode)
    releasing = python_turns_during(wrapped.encode)
    assert releasing > 10 * max(holding, 1), (holding, releasing)
