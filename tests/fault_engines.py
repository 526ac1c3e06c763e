"""Fault-injection engines, for tests only: the real transformers engine plus faults on cue.

Runs in a worker process started by a test (the registry names `test:tests.fault_engines.FaultyEngine`
and the test sets GATEWAY_ALLOW_TEST_ENGINES=1). A fault is triggered by a marker in the prompt,
so one worker serves healthy and faulty requests side by side:
  <<crash>>     step() raises (an engine exception: fatal for the worker)
  <<segfault>>  the process dies from SIGSEGV mid-generation
  <<hang>>      step() blocks for an hour (no steps, no heartbeats)
  <<stall>>     step() keeps returning nothing while jobs are active (wedged generator)
  <<slow>>      each step sleeps FAULT_SLOW_STEP_S (default 0.05 s)
  <<cue:PATH>>  holds the prompt's fault back (steps run slowly, as with <<slow>>) until the file
                PATH exists, then fires it at the next step: a test creates the file once it has
                seen what must come first (a stream's first event), instead of guessing a time
  <<warn>>      a library warns (torch's deprecated set_default_tensor_type, with no effect) and so
                does the engine, with a two-line message, as the job is submitted
Environment: FAULT_LOAD_DELAY_S delays load(); FAULT_CRASH_ON_LOAD=1 makes load() fail;
FAULT_WARMUP_STEP_S slows each warm-up step.
"""

from __future__ import annotations

import os
import re
import signal
import time
import warnings
from pathlib import Path

import torch

from model_worker.engines.base import ProgressCallback
from model_worker.engines.transformers.engine import TransformersEngine
from model_worker.engines.transformers.settings import TransformersSettings
from wire.params import SamplingParams
from wire.results import JobOutput

MARKERS = ("crash", "segfault", "hang", "stall", "slow")
WARNING_MARKER = "<<warn>>"
FAULT_AFTER_STEPS = 10  # late enough that Accepted has left the process
CUE = re.compile(r"<<cue:([^>]+)>>")


class FaultyEngine(TransformersEngine):
    Settings = TransformersSettings  # what the engine registry validates its engine_settings with

    def __init__(self, path: str, max_seq_len: int, settings: TransformersSettings) -> None:
        super().__init__(path, max_seq_len, settings)
        self._faults: dict[str, str] = {}
        self._steps_since_fault: dict[str, int] = {}
        self._cues: dict[str, Path] = {}

    def load(self, progress: ProgressCallback) -> None:
        delay = float(os.environ.get("FAULT_LOAD_DELAY_S", "0"))
        for i in range(int(delay * 10)):
            progress("injected slow load", i / max(delay * 10, 1))
            time.sleep(0.1)
        if os.environ.get("FAULT_CRASH_ON_LOAD") == "1":
            raise RuntimeError("injected load failure")
        super().load(progress)

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        text = self.decode(prompt_ids)
        if WARNING_MARKER in text:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                torch.set_default_tensor_type(torch.FloatTensor)  # the default already: only its warning
                warnings.warn("injected warning\nsecond line", FutureWarning, stacklevel=1)
        for marker in MARKERS:
            if f"<<{marker}>>" in text:
                self._faults[rid] = marker
                self._steps_since_fault[rid] = 0
        if rid in self._faults and (cue := CUE.search(text)):
            self._cues[rid] = Path(cue.group(1))
        super().submit(rid, prompt_ids, params)

    def cancel(self, rid: str) -> bool:
        self._faults.pop(rid, None)
        self._cues.pop(rid, None)
        return super().cancel(rid)

    def step(self) -> list[JobOutput]:
        # Slow warm-up makes the `warming` state long enough for a test to observe it.
        if any(rid.startswith("__warmup") for rid in self._running_rids()):
            time.sleep(float(os.environ.get("FAULT_WARMUP_STEP_S", "0")))
        for rid, fault in list(self._faults.items()):
            cue = self._cues.get(rid)
            if cue is not None:
                if not cue.exists():
                    time.sleep(float(os.environ.get("FAULT_SLOW_STEP_S", "0.05")))
                    continue
                self._steps_since_fault[rid] = FAULT_AFTER_STEPS  # the cue came: fire now
            self._steps_since_fault[rid] += 1
            if fault == "slow":  # the injected fault itself: a slow generator step
                time.sleep(float(os.environ.get("FAULT_SLOW_STEP_S", "0.05")))
            if self._steps_since_fault[rid] < FAULT_AFTER_STEPS:
                continue
            if fault == "crash":
                raise RuntimeError("injected engine fault")
            if fault == "segfault":
                os.kill(os.getpid(), signal.SIGSEGV)
            if fault == "hang":
                time.sleep(3600)
            if fault == "stall":
                return []
        outputs = super().step()
        for output in outputs:
            if output.finish_reason is not None:
                self._faults.pop(output.rid, None)
                self._cues.pop(output.rid, None)
        return outputs

    def _running_rids(self) -> list[str]:
        return [*self._active, *self._queue]
