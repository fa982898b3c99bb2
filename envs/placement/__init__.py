"""The Gymnasium environment ``rlplace/Placement-v0``: place an operator graph on a topology, one
decision per step (:class:`envs.placement.env.PlacementEnv`). Importing this package registers the id
(``import envs.placement``; in a fresh ``spawn`` process ``gym.make("envs.placement:rlplace/Placement-v0")``
imports it first).

Read it top-down: :mod:`~envs.placement.env` runs episodes; :mod:`~envs.placement.task_setup` prepares
each task once (coarsening, the option table, masks, co-location classes, roofline and memory
estimates, static features, the reference and the refine start); :mod:`~envs.placement.reward` is the
reward; :mod:`~envs.placement.observation` declares the observation (every key, its shape and bounds,
static or dynamic) and computes its arrays; :mod:`~envs.placement.options` is the option table and the
order in which nodes are decided.

Imports go one way: ``options <- observation <- task_setup <- env`` (``reward`` below ``task_setup``),
all of them on top of the world model (``envs.graph``, ``envs.topology``, ``envs.plan``, ``envs.coarsen``,
``envs.tasks``) and the simulator; nothing here imports ``agent``, ``profilers`` or ``experiments``.
Demonstration replay (driving the environment along a given plan) lives with imitation, in
:mod:`agent.imitation`.
"""

from envs.registration import register_envs

register_envs()
