"""bench/pool_turns.py: the turns of several benchmark runs pooled per engine, prompts and streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.pool_turns import main, pool


def result(
    engine: str, rows: list[dict[str, Any]], paged: bool = True, fresh: bool = False
) -> dict[str, Any]:
    return {"engine": engine, "settings": {"paged": paged, "fresh_prompts": fresh}, "rows": rows}


def row(path: str, streams: int, ratios: list[float], added: list[float]) -> dict[str, Any]:
    return {
        "path": path,
        "streams": streams,
        "paired_ratio_turns": ratios,
        "paired_ttft_added_ms_turns": added,
    }


def test_turns_of_the_same_engine_prompts_and_streams_pool_and_nothing_else_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = result("exllamav3", [row("gateway", 1, [0.9, 1.0, 0.95], [4.0, 6.0, 5.0]),
                                 row("gateway, env", 1, [2.0], [99.0]),  # another path: left out
                                 {"path": "raw", "streams": 1}])  # fmt: skip
    second = result("exllamav3", [row("gateway", 1, [0.97, 0.93, 0.96], [1.0, 2.0, 3.0])])
    fresh = result("exllamav3", [row("gateway", 1, [0.5], [50.0])], fresh=True)
    unpaged = result("exllamav2", [row("gateway", 1, [1.1], [0.0])], paged=False)
    pooled = pool([(run, "gateway") for run in (first, second, fresh, unpaged)])
    repeated = pooled[("exllamav3", "repeated prompts", 1)]
    assert (repeated.runs, sorted(repeated.ratios)) == (2, [0.9, 0.93, 0.95, 0.96, 0.97, 1.0])
    assert sorted(repeated.ttft_added_ms) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert pooled[("exllamav3", "new prompts", 1)].ratios == [0.5]
    assert pooled[("exllamav2 unpaged", "repeated prompts", 1)].ratios == [1.1]
    assert len(pooled) == 3

    files = []
    for n, run in enumerate([first, second]):
        files.append(tmp_path / f"run{n}.json")
        files[-1].write_text(json.dumps(run))
    main([str(f) for f in files])
    # Six turns are enough for a 95 % interval of the median: the 1st and 6th order statistics.
    assert capsys.readouterr().out.splitlines() == [
        "exllamav3, repeated prompts, 1 streams: 2 runs, 6 turns, ratio 0.955 (0.900 to 1.000), "
        "first token added 3.5 (1.0 to 6.0) ms"
    ]


def test_a_file_may_name_its_own_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that measured the shipped worker as its compared worker pools that row, not 'gateway'."""
    shipped = result("exllamav3", [row("gateway", 1, [0.9], [4.0])])
    compared = result("exllamav3", [row("gateway", 1, [0.1], [90.0]), row("gateway, env", 1, [1.0], [6.0])])
    files = [tmp_path / "shipped.json", tmp_path / "compared.json"]
    for file, run in zip(files, (shipped, compared), strict=True):
        file.write_text(json.dumps(run))
    main([str(files[0]), f"{files[1]}@gateway, env"])
    out = capsys.readouterr().out
    assert "2 runs, 2 turns, ratio 0.950" in out and "first token added 5.0" in out
