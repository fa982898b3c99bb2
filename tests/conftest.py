import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Keep calibration files and caches out of the user's home."""
    monkeypatch.setenv("RLPLACE_HOME", str(tmp_path / "rlplace-home"))
