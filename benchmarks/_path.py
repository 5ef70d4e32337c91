"""Imported first by a script run by path (``python benchmarks/NAME.py``, where only benchmarks/ is on
sys.path): puts the repository root on sys.path so that ``from benchmarks.x import y`` and ``tests.support``
resolve to this checkout. The one place a benchmark touches sys.path."""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
