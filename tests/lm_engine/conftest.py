"""Engine-test fixtures: transformers' generate() on the tiny checkpoint as the oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import HFOracle


@pytest.fixture(scope="session")
def hf_oracle(tiny_ckpt: Path) -> HFOracle:
    return HFOracle(tiny_ckpt)
