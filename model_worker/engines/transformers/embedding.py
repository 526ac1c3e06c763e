"""The transformers embedding engine: a sentence-transformers model on CPU or one GPU.

Runs in a worker process whose model is declared `task: embed`, driven by the serve loop's single
thread. Owns the model as sentence-transformers loads it from the folder (modules.json: the
transformer, the model's own pooling from 1_Pooling/config.json, Normalize when listed), so the
pooling and normalization are the model's, not ours. Inputs arrive as token ids (the worker's
prompt thread tokenizes texts with this engine's `text_codec`, which also counts usage); `embed`
runs them in batches of `max_batch_size`, sorted by length so padding stays small
(model_worker.embedding_batch already hands it one such batch at a time). It generates nothing:
`submit` refuses, and it never has work to step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import transformers

from model_worker.devices import cuda_devices, gpu_memory_used_bytes
from model_worker.engines.base import ProgressCallback, RequestRejected, TextCodec
from model_worker.engines.transformers.codec import TokenizerCodec
from model_worker.engines.transformers.settings import TransformersSettings
from wire.params import SamplingParams
from wire.results import JobOutput, RejectCode, TokenLogprob
from wire.stats import EngineInfo, EngineStats

logger = logging.getLogger(__name__)


class EmbeddingEngine:
    def __init__(self, path: str, max_seq_len: int, settings: TransformersSettings) -> None:
        self.path = path
        self.max_seq_len = max_seq_len
        self.settings = settings
        self._model: Any = None
        self._device = torch.device("cpu")
        self._pad_id = 0
        self._vocab_size = 0
        self._embedded = 0

    def load(self, progress: ProgressCallback) -> None:
        from sentence_transformers import SentenceTransformer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        progress("loading weights", 0.0)
        self._model = SentenceTransformer(self.path, device=str(self._device), local_files_only=True)
        self._model.eval()
        tokenizer = self._model.tokenizer
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._vocab_size = len(tokenizer)
        logger.info("loaded embedding model %s on %s: %s", self.path, self._device, self._model)
        progress("loaded", 1.0)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return TokenizerCodec(self._model.tokenizer).encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return TokenizerCodec(self._model.tokenizer).decode(token_ids)

    def text_codec(self) -> TextCodec:
        return TokenizerCodec(self._model.tokenizer).copy()

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """One vector per input, in order, through the model's own modules (pooling, Normalize)."""
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        vectors: list[list[float]] = [[] for _ in inputs]
        batch = self.settings.max_batch_size
        with torch.inference_mode():
            for start in range(0, len(order), batch):
                indices = order[start : start + batch]
                width = max(len(inputs[i]) for i in indices)
                ids = torch.full((len(indices), width), self._pad_id, dtype=torch.long)
                mask = torch.zeros((len(indices), width), dtype=torch.long)
                for row, i in enumerate(indices):
                    ids[row, : len(inputs[i])] = torch.tensor(inputs[i], dtype=torch.long)
                    mask[row, : len(inputs[i])] = 1
                features = {"input_ids": ids.to(self._device), "attention_mask": mask.to(self._device)}
                pooled = self._model(features)["sentence_embedding"].float().cpu().tolist()
                for row, i in enumerate(indices):
                    vectors[i] = pooled[row]
        self._embedded += len(inputs)
        return vectors

    # ---- the generation half of the Engine interface: an embedding model generates nothing --------

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        raise RequestRejected(RejectCode.INVALID_REQUEST, "this is an embedding model", "model")

    def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob]:
        raise RequestRejected(RejectCode.INVALID_REQUEST, "this is an embedding model", "model")

    def cancel(self, rid: str) -> bool:
        return False

    def step(self) -> list[JobOutput]:
        return []

    def has_work(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(
            jobs_finished=self._embedded,
            gpu_memory_used_bytes=gpu_memory_used_bytes() if self._device.type == "cuda" else {},
        )

    def info(self) -> EngineInfo:
        return EngineInfo(
            engine="transformers",
            engine_version=transformers.__version__,
            max_seq_len=self.max_seq_len,
            max_batch_size=self.settings.max_batch_size,
            max_chunk_size=self.settings.max_chunk_size,
            vocab_size=self._vocab_size,
            paged=False,
            devices=cuda_devices() if self._device.type == "cuda" else [],
            configured_max_batch_size=self.settings.max_batch_size,
        )

    def close(self) -> None:
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
