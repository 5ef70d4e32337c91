"""decode_ab's report: its table and median line from a result file's rounds (a regression: the report once
called a helper that had moved, after the rounds had run)."""

from __future__ import annotations

from benchmarks import decode_ab


def test_report_lines_render_every_round_and_the_medians():
    round_ = {
        "round": 0,
        "vlmserve": {"ms_per_token": 140.04},
        "llama.cpp": {"ms_per_token": 165.33},
        "ratio": 0.847,
        "read_gbs": 24.44,
        "floor_ms": 126.6,
    }
    result = {
        "label": "qwen2-vl-2b",
        "machine": {"cpu_model": "Some CPU", "flags": ["avx2", "amx_bf16"]},
        "rounds": [round_, {**round_, "round": 1, "ratio": None}],
        "summary": {
            "vlmserve_ms": 140.04,
            "llamacpp_ms": 165.33,
            "ratio_median": 0.847,
            "vlmserve_over_floor": 1.106,
            "llamacpp_over_floor": None,
        },
    }
    lines = decode_ab.report_lines(result)
    assert lines[0] == "decode_ab: qwen2-vl-2b, CPU Some CPU (avx2 amx_bf16)"
    assert lines[3] == "| 0 | 140.0 | 165.3 | 0.847 | 24.4 | 126.6 |"
    assert lines[4].startswith("| 1 | 140.0 | 165.3 | ")
    assert lines[-1].startswith("median: vlmserve 140.0, llama.cpp 165.3, ratio 0.847; ÷ floor 1.11 and ")
