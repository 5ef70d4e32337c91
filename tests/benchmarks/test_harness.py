"""benchmarks/harness.py's result files and the scripts' one sys.path preamble: a summary in the tree, the
bulky records beside it under benchmarks/out/, and every script runnable by path from anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[2]


def test_write_results_keeps_the_summary_and_sends_the_records_out(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(harness, "OUT_DIR", tmp_path / "out")
    body = {"command": "python x.py --quick", "created": "2026-12-07T01:00:00+0000", "ratio": 2.5}
    bulk = harness.write_results(
        tmp_path / "results" / "x", body, "A title", ["| a |"], [{"i": 0}], stem="run"
    )
    assert bulk == (tmp_path / "out" / "x").resolve()
    assert sorted(p.name for p in (tmp_path / "results" / "x").iterdir()) == ["run.json", "run.md"]
    assert json.loads((tmp_path / "results" / "x" / "run.json").read_text())["ratio"] == 2.5
    md = (tmp_path / "results" / "x" / "run.md").read_text().splitlines()
    assert (
        md[0] == "# A title"
        and md[2] == "`python x.py --quick` — 2026-12-07T01:00:00+0000"
        and md[-1] == "| a |"
    )
    assert json.loads((bulk / "run_records.json").read_text()) == [{"i": 0}]


def test_an_out_dir_elsewhere_keeps_everything_together(tmp_path: Path) -> None:
    assert harness.bulk_dir(tmp_path / "elsewhere") == (tmp_path / "elsewhere").resolve()
    assert harness.bulk_dir(harness.RESULTS_DIR / "serve_compare") == harness.OUT_DIR / "serve_compare"


@pytest.mark.parametrize("script", ["serve_compare.py", "visual_budget.py", "real_size.py"])
def test_a_script_runs_by_path_from_another_directory(script: str, tmp_path: Path) -> None:
    """The documented command, from a directory that holds nothing of the repository and with no PYTHONPATH:
    benchmarks/_path.py alone makes ``from benchmarks.x import y`` resolve."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"usage: {script}" in out.stdout
