"""The benchmark suite behind ``rlplace bench``: every placer and the trained agent on every case,
against lower bounds.

:mod:`agent.benchmark.suite` reads a suite file (schema-checked: one line naming the field) and
resolves its cases to graphs and topologies; :mod:`agent.benchmark.runner` runs the placers and the
agent columns (``policy``: the policy zero-shot; ``policy+search``: policy-guided search at an
evaluation budget) on them, case by case in-process or as Ray tasks (:mod:`agent.scale`);
:mod:`agent.benchmark.results` writes ``results.csv``, ``results.md`` and ``ratios.png``. Suites are
found by name in the checkout's ``experiments/suites/`` (see :mod:`agent.checkout`) or given as a path.
May import ``agent.placers``, ``agent.lower_bound``, ``agent.resolve``, ``agent.infer``,
``agent.distribution``, ``agent.scale`` and ``envs``; nothing of the command line or of ``experiments``.
"""
