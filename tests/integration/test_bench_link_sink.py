"""bench/link_sink.py: our engine's in-process rounds with each step's Step frame sent each way
(by the worker's link thread, by the engine thread itself, and by the bare floor threads; `take`
takes each frame and sends nothing).

Runs in the pytest process with the CPU demo engine and a real sink process over ipc; checks that
every step's frame reaches the sink on every path, and that the rounds' tokens are all there.
"""

from __future__ import annotations

from pathlib import Path

from bench.link_sink import MODES, FrameSink
from bench.streams import engine_round
from model_worker.engines.registry import create_engine


def test_every_steps_frame_reaches_the_sink_on_every_path(demo_model_dir: Path) -> None:
    engine = create_engine("transformers", str(demo_model_dir), 256, {})
    engine.load(lambda detail, progress: None)
    prompts = [engine.encode(f"stream {i} says hello", True) for i in range(3)]
    steps = 0
    try:
        with FrameSink() as sink:
            for mode in MODES:
                send = sink.sender(mode)
                done = engine_round(engine, prompts, 12, None, send)
                assert [s.tokens for s in done.streams] == [12, 12, 12], mode
                if mode != "take":
                    # Each step with outputs stamps its tokens with one time of its own.
                    steps += len({t for stream in done.streams for t in stream.token_times})
    finally:
        engine.close()
    assert sink.frames_taken == steps  # one frame per step that gave tokens, none lost or doubled
