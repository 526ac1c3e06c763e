"""Prompt logprobs (scoring) from logits, shared by every engine that implements them.

Runs in the worker process, on the serve loop's thread, inside an engine's `prompt_logprobs`.
Owns turning one chunk of log-softmaxed logits into the wire's `TokenLogprob` entries, vLLM's
way: each prompt token's logprob given the tokens before it, its rank (1 = most likely) and the
top alternatives; the first prompt token has none (logprob None). Engines feed the prompt in
bounded chunks, so the full [prompt x vocabulary] matrix never exists at once. torch is handed in
by the engines (this module imports it only inside functions).
"""

from __future__ import annotations

from typing import Any

from model_worker.engines.token_texts import TokenTexts
from wire.results import TokenLogprob, TopLogprob


def first_entry(token_id: int, texts: TokenTexts) -> TokenLogprob:
    """The first prompt token: nothing precedes it, so it has no logprob (null in the API)."""
    return TokenLogprob(texts(token_id), token_id, None, [])


def score_rows(logprobs: Any, targets: list[int], top: int, texts: TokenTexts) -> list[TokenLogprob]:
    """Entries for `targets[i]` scored by row i of `logprobs` ([len(targets), vocab], float32 log-softmax)."""
    import torch

    if not targets:
        return []
    target = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    alternatives: list[list[tuple[int, float]]] = [[] for _ in targets]
    if top > 0:
        values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
        alternatives = [
            list(zip(ids, lps, strict=True))
            for ids, lps in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    return [
        TokenLogprob(texts(token), token, logprob, [TopLogprob(texts(t), t, lp) for t, lp in alts], rank)
        for token, logprob, rank, alts in zip(
            targets, chosen.tolist(), ranks.tolist(), alternatives, strict=True
        )
    ]
