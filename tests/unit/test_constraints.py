"""Constraint budgets in the worker: the size estimate of a regular expression's automaton, and the
compiler's refusals (too large at once, too slow at its budget, the same again at once) and its cache.
The compiler's process is real: the slow compile is killed and the next one runs in a fresh child."""

from __future__ import annotations

import json

import pytest
from lmformatenforcer import RegexParser

from model_worker.constraints import ConstraintCompiler, estimated_states
from model_worker.engines.base import RequestRejected
from model_worker.engines.structured_output import build_parser, is_compiled
from tests.harness import wait_until
from wire.params import SamplingParams


@pytest.mark.parametrize(
    ("pattern", "low", "high"),
    [
        ("[a-z]{1,30000}", 30000, 30001),
        ("(ab|cd){1,300}", 1200, 1201),
        (r"(\d{3}-){1,100}\d{4}", 400, 405),
        ("[a-z]+@[a-z]+", 3, 10),
        ("x{2,}", 3, 3),
    ],
)
def test_size_estimate_follows_the_repeats(pattern: str, low: int, high: int) -> None:
    assert low <= estimated_states(pattern) <= high


@pytest.mark.parametrize("pattern", ["(?=a)a+", "a+(?=b)", "(?!x)[a-c]+", "(?<=a)b", "(?<!a)b"])
def test_lookarounds_are_refused_before_they_are_compiled(pattern: str) -> None:
    """interegular reads a lookaround as something else (`a+(?=b)` matched "ab"; `(?=a)a+` let any
    text through after the "a"), so the enforcer allowed what the pattern forbids."""
    compiler = ConstraintCompiler(timeout_s=5, max_states=4096)
    try:
        for params in (SamplingParams(regex=pattern), schema(pattern)):
            with pytest.raises(RequestRejected, match="lookarounds") as refused:
                compiler.needed(params)
            assert refused.value.code == "invalid_response_format"
    finally:
        compiler.close()


def schema(pattern: str) -> SamplingParams:
    body = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    return SamplingParams(json_schema=json.dumps(body))


def wait(compiler: ConstraintCompiler, key: tuple[object, ...]) -> bool:
    """The compile's outcome (True, or its RequestRejected raised); polled often, as the worker does
    between steps: each poll is also when the compiler checks its time budget."""
    return wait_until(lambda: compiler.result(key), "the compile's outcome", poll_s=0.01)


def test_budgets_and_cache() -> None:
    compiler = ConstraintCompiler(timeout_s=0.05, max_states=4096)
    try:
        with pytest.raises(RequestRejected, match="max_constraint_states"):
            compiler.needed(schema("^[a-z]{1,30000}$"))
        with pytest.raises(RequestRejected, match="invalid"):
            compiler.needed(SamplingParams(regex="(unclosed"))
        slow = schema("^[a-z]{1,3000}$")
        assert compiler.needed(slow)
        with pytest.raises(RequestRejected, match="within 0.05s"):
            wait(compiler, compiler.start(slow))
        # Remembered: refused at once, where a constraint it does not know returns True (compile it).
        with pytest.raises(RequestRejected, match="within 0.05s"):
            compiler.needed(slow)
        fast = schema("^[0-9]{4}$")
        assert compiler.needed(fast)
        assert wait(compiler, compiler.start(fast)) is True
        assert is_compiled(fast) and not compiler.needed(fast)  # cached: the next job starts at once
        assert not compiler.needed(SamplingParams())  # no constraint: nothing to wait for
    finally:
        compiler.close()


def test_compiled_parsers_reach_the_worker_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the compiler's process built is what the worker steps with: a schema pattern's automaton
    comes along (no step ever builds one, which took seconds mid-step for large patterns), and an
    automaton with a negated class still knows "any other character" after the trip."""
    import interegular

    in_schema = schema("^[a-z]{1,40}[0-9]$")
    negated = SamplingParams(regex="[^a]{2,5}")
    compiler = ConstraintCompiler(timeout_s=60, max_states=4096)
    try:
        for params in (in_schema, negated):
            assert compiler.needed(params)
            assert wait(compiler, compiler.start(params)) is True
    finally:
        compiler.close()

    def no_automaton_here(*_: object, **__: object) -> None:
        raise AssertionError("an automaton was built in the worker")

    monkeypatch.setattr(interegular, "parse_pattern", no_automaton_here)
    parser = build_parser(in_schema)
    for character in '{"s": "ab':
        parser = parser.add_character(character)
    allowed = parser.get_allowed_characters()
    assert "z" in allowed and "9" in allowed and "A" not in allowed

    parser = build_parser(negated).add_character("b")
    allowed = parser.get_allowed_characters()
    assert "c" in allowed and "a" not in allowed
    assert parser.add_character("a").current_state == RegexParser.INVALID_STATE
