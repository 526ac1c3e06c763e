"""Prompt logprobs on the exllamav2 engine: one forward pass over the prompt with its own cache.

Runs in a worker process, on the serve loop's thread (the only one that touches the model), called
through `ExLlamaV2Engine.prompt_logprobs` before the job is enqueued. The generator's paged cache
is left alone: the pass uses a temporary contiguous cache sized to the prompt (freed when it
returns), and feeds the prompt in max_chunk_size pieces, so only one chunk's logits
([chunk x vocabulary]) exist at a time. Each piece's logits score the tokens that follow it.
"""

from __future__ import annotations

from typing import Any

from model_worker.engines.prompt_scoring import first_entry, score_rows
from model_worker.engines.token_texts import TokenTexts
from wire.results import TokenLogprob

PAGE = 256  # exllamav2 caches are allocated in whole pages of this many tokens


def prompt_logprobs(
    model: Any, prompt_ids: list[int], top: int, chunk: int, vocab_size: int, texts: TokenTexts
) -> list[TokenLogprob]:
    import exllamav2
    import torch

    entries = [first_entry(prompt_ids[0], texts)]
    scored = len(prompt_ids) - 1  # the last token scores nothing that is part of the prompt
    if scored == 0:
        return entries
    cache = exllamav2.ExLlamaV2Cache(model, max_seq_len=-(-scored // PAGE) * PAGE, batch_size=1)
    try:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.inference_mode():
            for start in range(0, scored, chunk):
                end = min(start + chunk, scored)
                # forward() appends this piece to the cache and advances it; logits are fp16, padded
                # to a multiple of 32 columns: cut to the vocabulary before the softmax.
                logits = model.forward(ids[:, start:end], cache=cache, last_id_only=False)
                logprobs = torch.log_softmax(logits[0, :, :vocab_size].float(), dim=-1)
                entries += score_rows(logprobs, prompt_ids[start + 1 : end + 1], top, texts)
    finally:
        del cache
    return entries
