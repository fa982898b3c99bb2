"""Gymnasium registration of the rlplace environments (``import envs.placement`` runs it)."""

from __future__ import annotations

ENV_IDS = {"rlplace/Placement-v0": "envs.placement.env:PlacementEnv"}


def register_envs() -> None:
    """Register every rlplace environment id once (idempotent; the entry points import lazily)."""
    import gymnasium

    for env_id, entry in ENV_IDS.items():
        if env_id not in gymnasium.registry:
            gymnasium.register(id=env_id, entry_point=entry)
