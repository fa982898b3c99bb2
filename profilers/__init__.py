"""From PyTorch to rlplace and back: models to OpGraphs, op timings and calibration, real execution.

``profilers.zoo`` / ``profilers.spec`` name the model families, ``profilers.trace`` traces a model into
an OpGraph (``torch.export`` on meta tensors), ``profilers.hf`` and ``profilers.dnn_partitioning``
import other formats, ``profilers.calibration`` times ops on this host and fits a device model
(``profilers.step_calibration`` fits a topology's cost parameters to measured step times of whole plans).
``profilers.execution_layout`` turns a plan into an execution layout, ``profilers.rank_program`` is what
each rank runs, launched by ``profilers.execute`` (one run) or ``profilers.measured_evaluator`` (a
persistent pool measuring plans as rewards). Imports ``envs`` (graphs, plans, topologies, the simulator
for memory and predictions), never ``agent`` or ``experiments``.
"""
