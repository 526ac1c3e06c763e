"""Structured output on the GPU engines, inside a batch: lm-format-enforcer's filter in exllamav2's
generator (both modes), llguidance's in exllamav3's.

Runs in the pytest process on the GPU machine, on the session's tiny random-weight model, once per
engine mode. That model knows nothing about JSON, so every bit of structure comes from the filter;
it never closes a free-form string by itself, so the schema bounds every string (maxLength, enum)
and array (maxItems). The check is by hand: jsonschema is not in the GPU image.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.gpu.support import SKIP_REASON, record, run_job, run_jobs

if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from model_worker.engines.base import RequestRejected  # noqa: E402
from wire.params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT = "Describe a fruit as JSON:"
COLORS = ["red", "yellow", "green"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "fruit": {"type": "string", "maxLength": 10},
        "color": {"enum": COLORS},
        "seeds": {"type": "integer"},
        "ripe": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["fruit", "color", "seeds", "ripe", "tags"],
    "additionalProperties": False,
}


def _check(value: Any) -> None:
    assert isinstance(value, dict) and sorted(value) == sorted(SCHEMA["properties"]), value
    assert isinstance(value["fruit"], str) and len(value["fruit"]) <= 10
    assert value["color"] in COLORS
    assert isinstance(value["seeds"], int) and not isinstance(value["seeds"], bool)
    assert isinstance(value["ripe"], bool)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(isinstance(t, str) and len(t) <= 5 for t in value["tags"])


def test_json_schema_greedy_and_sampled(engine: Any, mode: str) -> None:
    ids = engine.encode(PROMPT, True)
    schema = json.dumps(SCHEMA)
    jobs = {"greedy": (ids, SamplingParams(max_tokens=1024, temperature=0.0, json_schema=schema))}
    for seed in range(3):
        jobs[f"sampled-{seed}"] = (
            ids,
            SamplingParams(max_tokens=1024, temperature=1.0, seed=seed, json_schema=schema),
        )
    jobs["free"] = (ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    runs = run_jobs(engine, jobs)  # concurrently: each job's filter keeps its own state
    for rid, run in runs.items():
        if rid == "free":  # a job without a filter in the same batch is not constrained by theirs
            assert len(run.token_ids) == 64 and run.final.finish_reason == "length"
            continue
        assert run.final.finish_reason == "stop", (rid, run.text)
        _check(json.loads(run.text))
    record(f"structured output tiny {mode}", tokens=[len(r.token_ids) for r in runs.values()])


def test_json_object_with_ignore_eos_still_stops(engine: Any) -> None:
    # JSON mode bounds nothing; a bias towards `"` and `}` lets this model close strings and the
    # object, while which characters are legal stays the filter's call.
    quote, close = engine.encode('"', False)[-1], engine.encode("}", False)[-1]
    params = SamplingParams(
        max_tokens=512,
        temperature=0.0,
        ignore_eos=True,
        json_object=True,
        logit_bias={quote: 20.0, close: 8.0},
    )
    run = run_job(engine, engine.encode(PROMPT, True), params)
    assert run.final.finish_reason == "stop", run.text
    assert isinstance(json.loads(run.text), dict)


def test_schema_the_enforcer_cannot_use_is_rejected(engine: Any) -> None:
    params = SamplingParams(json_schema=json.dumps({"type": "frobnicate"}))
    with pytest.raises(RequestRejected) as rejected:
        engine.submit("bad-schema", engine.encode(PROMPT, True), params)
    assert rejected.value.code == "invalid_response_format"
    assert not engine.has_work()
