"""rlplace's world model (OpGraph, Topology, Plan, simulator) and its Gymnasium environments.

Importing ``envs`` registers ``rlplace/Placement-v0`` (:class:`envs.placement_env.PlacementEnv`)."""

from envs.registration import register_envs

register_envs()
