"""One module per ``rlplace`` command (``register(app)`` adds it to :mod:`agent.cli`): argument parsing,
checks of paths and options before any work, and printing. The work itself is library code in
``agent``, ``envs`` and ``profilers``; nothing outside ``agent.cli`` and this package imports it.
"""
