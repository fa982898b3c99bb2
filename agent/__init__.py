"""The placement agent and the ``rlplace`` command line.

The library: the GNN policy (``agent.policy``), PPO training over a distribution of tasks
(``agent.train``, its config schema ``agent.config``, callbacks, imitation and self-imitation), placing
one model with a trained policy (``agent.infer``), the heuristic and search placers (``agent.placers``),
lower bounds (``agent.lower_bound``), the benchmark suite (``agent.benchmark``), the demo
(``agent.demo``) and what a placement looks like on a console (``agent.report``). It imports ``envs``
and ``profilers``, never ``experiments`` (whose configs and suites it reads by path, see
``agent.checkout``) and never the command line. The command line (``agent.cli``, one module per
command in ``agent.commands``) sits on top and is imported by nothing in the library.
"""
