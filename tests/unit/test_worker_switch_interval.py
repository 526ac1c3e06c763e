"""The worker's GIL switch interval: short by default, set per model by its registry `env`, and a
bad value refused with the variable's name. Runs in the test process (the function only calls
sys.setswitchinterval; the interval is restored after each test)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from model_worker.main import (
    DEFAULT_SWITCH_INTERVAL_MS,
    SWITCH_INTERVAL_VARIABLE,
    _short_gil_switch_interval,
)


@pytest.fixture(autouse=True)
def restored_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_default_is_shorter_than_cpythons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SWITCH_INTERVAL_VARIABLE, raising=False)
    sys.setswitchinterval(0.005)
    _short_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_SWITCH_INTERVAL_MS / 1000)
    assert sys.getswitchinterval() < 0.005


def test_the_models_env_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SWITCH_INTERVAL_VARIABLE, "5")
    _short_gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("value", ["0", "-1", "fast", "1001"])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(SWITCH_INTERVAL_VARIABLE, value)
    before = sys.getswitchinterval()
    with pytest.raises(SystemExit, match=SWITCH_INTERVAL_VARIABLE) as refused:
        _short_gil_switch_interval()
    assert repr(value) in str(refused.value)
    assert sys.getswitchinterval() == before
