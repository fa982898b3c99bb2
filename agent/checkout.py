"""Where installed code finds the repository's ``experiments/`` folder (training configs and suites).

``experiments/`` is not installed: it holds scripts, configs, suites and results, and nothing installed
imports it. Installed code reads two kinds of its files by path, relative to the checkout the ``agent``
package sits in (``pip install -e .`` keeps the package in the checkout)::

    <checkout>/experiments/configs/NAME.yaml   training configs (``rlplace demo`` reads demo.yaml)
    <checkout>/experiments/suites/NAME.yaml    benchmark suites (``rlplace bench --suite NAME``)

A name that is not there raises the caller's one-line error saying where it looked; a path to a file
always works, installed from a checkout or not.
"""

from __future__ import annotations

from pathlib import Path

from envs.errors import RlplaceError

CHECKOUT = Path(__file__).resolve().parents[1]
EXPERIMENTS = CHECKOUT / "experiments"
CONFIGS_DIR = EXPERIMENTS / "configs"
SUITES_DIR = EXPERIMENTS / "suites"
# shared/ sits beside the repository checkout (as in CI); suites read workloads from it
DEFAULT_WORKLOADS = CHECKOUT.parent / "shared" / "workloads"


def experiments_file(folder: Path, name: str, what: str, error: type[RlplaceError], *,
                     path_allowed: bool = True) -> Path:
    """``folder/NAME.yaml`` (``folder`` one of :data:`CONFIGS_DIR`, :data:`SUITES_DIR`), or ``error``
    naming the file and the known names when it is not there (``path_allowed``: the caller also takes a
    path to a file, and the message says so)."""
    path = folder / f"{name}.yaml"
    if path.is_file():
        return path
    if not folder.is_dir():
        raise error(f"{what} {name!r} not found: there is no folder {folder} (the {what}s live in the "
                    "experiments/ folder of a checkout installed with `pip install -e .`)"
                    + ("; give a path to a .yaml file" if path_allowed else ""))
    names = ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) or "none"
    raise error(f"unknown {what} {name!r}; {what}s in {folder}: {names}"
                + (" (or a path to a .yaml file)" if path_allowed else ""))


__all__ = ["CHECKOUT", "EXPERIMENTS", "CONFIGS_DIR", "SUITES_DIR", "DEFAULT_WORKLOADS", "experiments_file"]
