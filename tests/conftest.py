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


# ---------------------------------------------------------------------- file fuzzing (shared strategies)
def json_paths(doc, prefix=()):
    """Every (path, value) in a JSON-like document, containers included."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, prefix + (i,))


BAD_VALUES = ["abc", "", None, True, False, [], {}, [1, 2], {"x": 1}, -1, 0, 1.7, -1e30, 1e308, 2**70,
              float("nan"), float("inf"), float("-inf"), "1e9", "0123", -0.0]


def mutations():
    """A hypothesis strategy of functions that break a JSON-like document in one place (wrong type,
    missing or extra key, NaN / inf / negative / huge number)."""
    from hypothesis import strategies as st

    return st.tuples(st.integers(min_value=0, max_value=10**9),
                     st.sampled_from(["replace", "delete", "extra", "append"]),
                     st.sampled_from(BAD_VALUES))


def mutate(doc, mutation):
    """Apply one ``mutations()`` draw to a deep copy of ``doc``."""
    import copy

    doc = copy.deepcopy(doc)
    pick, how, value = mutation
    paths = list(json_paths(doc))
    path, target = paths[pick % len(paths)]
    if how == "extra" and isinstance(target, dict):
        target["unknown_key_x"] = value
        return doc
    if how == "append" and isinstance(target, list):
        target.append(value)
        return doc
    if not path:
        return value if how == "replace" else {}
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc
