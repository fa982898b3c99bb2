"""Scripts, configs, suites and results: not installed, and nothing installed imports them.

Run the scripts from the checkout (``python -m experiments.NAME``); ``configs/`` holds the training
configs (``rlplace train --config``, ``rlplace demo``), ``suites/`` the benchmark suites
(``rlplace bench --suite``) and ``results/`` the committed reports. Scripts import anything.
"""
