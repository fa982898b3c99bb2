"""rlplace's world model and its Gymnasium environment.

The world model — errors (``envs.errors``), operator graphs (``envs.graph``), device topologies and
their presets (``envs.topology``, ``envs.presets``), plans (``envs.plan``), files and their schema
(``envs.files``, ``envs.schema``), coarsening (``envs.coarsen``) and tasks (``envs.tasks``) — imports
neither gymnasium nor anything outside ``envs``. On top of it sit the simulator (``envs.sim``) and the
environment ``rlplace/Placement-v0`` (``envs.placement``), which alone imports gymnasium and registers
the id when it is imported. Nothing in ``envs`` imports ``agent``, ``profilers`` or ``experiments``.
"""
