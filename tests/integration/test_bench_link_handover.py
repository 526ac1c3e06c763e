"""bench/bench_link_handover.py, run as its own process on this machine's CPUs: every mode's
rounds are measured and paired against the rounds without a frame, and every frame sent reaches
the sink process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.link_sink import MODES

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_each_mode_is_paired_by_round_and_no_frame_is_lost(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "bench" / "bench_link_handover.py"),
            "--jobs",
            "2,4",
            "--rounds",
            "3",
            "--steps",
            "12",
            "--gil-free-ops",
            "2",
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    [result_file] = tmp_path.glob("link_handover_*.json")
    result = json.loads(result_file.read_text())
    assert result["frames_taken"] == result["frames_sent"] > 0
    for jobs in ("2", "4"):
        level = result["levels"][jobs]
        assert list(level) == ["none", *MODES]
        assert level["none"]["paired_ratio"] == 1.0
        for mode in MODES:
            assert len(level[mode]["step_ms_rounds"]) == 3
            assert level[mode]["step_ms_p50"] > 0
            row = level[mode]
            assert 0 < row["paired_ratio_min"] <= row["paired_ratio"] <= row["paired_ratio_max"]
    assert (tmp_path / result_file.with_suffix(".md").name).read_text().count("| 4 |") == len(MODES) + 1
