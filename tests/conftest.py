"""Shared test fixtures.

Real data lives in ``../shared/data`` beside the checkout (not part of the package); set
``VASWANI_SHARED_DATA`` to point elsewhere. Tests that need it skip with a clear reason when absent.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("VASWANI_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA} (set VASWANI_SHARED_DATA)")
    return SHARED_DATA
