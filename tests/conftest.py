import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Keep calibration files and caches out of the user's home."""
    monkeypatch.setenv("RLPLACE_HOME", str(tmp_path / "rlplace-home"))


@pytest.fixture
def cli(capsys):
    """Run ``rlplace ARGS...`` in-process: returns (exit code, stdout, stderr)."""
    from agent.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # pragma: no cover - main returns its code; kept for safety
            code = exc.code if isinstance(exc.code, int) else 2
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
