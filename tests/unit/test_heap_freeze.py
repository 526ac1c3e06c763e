"""The start-up heap kept out of full garbage collections: the gateway's, and a worker's model until
it is unloaded.

Runs in the pytest process. Each test leaves the collector as it found it (nothing frozen).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from gateway.heap import freeze_startup_heap, refreeze_after_reload
from model_worker.serve_loop import Worker


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class Model:
    """Stands in for a loaded engine: its objects refer to each other, as a model's modules do."""

    def __init__(self) -> None:
        self.layers = [{"owner": self} for _ in range(3)]
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_gateway_freezes_what_start_up_built() -> None:
    built_at_start_up = Model()
    assert gc.get_freeze_count() == 0
    asyncio.run(freeze_startup_heap())
    assert gc.get_freeze_count() > 0
    # A full collection no longer visits it.
    assert not any(obj is built_at_start_up for obj in gc.get_objects(generation=2))


def test_a_reload_collects_what_it_left_behind_and_freezes_the_rest() -> None:
    old_model = Model()
    gone = weakref.ref(old_model)
    asyncio.run(freeze_startup_heap())
    del old_model  # the reload dropped it, but its cycle was frozen
    gc.collect()
    assert gone() is not None  # so a collection alone never frees it
    refreeze_after_reload()
    assert gone() is None
    assert gc.get_freeze_count() > 0


def test_refreezing_leaves_a_heap_that_was_never_frozen_alone() -> None:
    refreeze_after_reload()
    assert gc.get_freeze_count() == 0


def test_an_unloaded_model_is_collected_although_it_was_frozen() -> None:
    model = Model()
    gone = weakref.ref(model)
    gc.collect()
    gc.freeze()  # as the worker does once the model is loaded and warm
    worker = SimpleNamespace(link=SimpleNamespace(serve_prompts=lambda desk: None), jobs=None,
                             engine=model, info=None, embeddings=None, _ready=None)  # fmt: skip
    del model
    Worker.release_model(worker)  # type: ignore[arg-type]
    assert gone() is None, "the unloaded model's objects stayed: a frozen cycle is never collected"
    assert gc.get_freeze_count() == 0
