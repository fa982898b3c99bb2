"""The reward of a complete plan: scale-free, so that tasks of any size train together.

``plan_reward = log(T_ref / T_plan)``, where ``T_ref`` is the task's reference time (the better, non-OOM
first, of the standard single-device and data-parallel plans; :func:`envs.placement.task_setup.reference`).
An OOM plan gets ``-1 - log(peak / capacity) on the worst device + min(0, log(T_ref / T_plan))``: below
-1, growing with the overflow, and never above the same plan's time reward, so fitting in memory
always pays.
"""

from __future__ import annotations

import numpy as np

from envs.evaluator import EvalResult


def plan_reward(result: EvalResult, ref_time: float) -> float:
    """The reward of a plan evaluated as ``result`` on a task whose reference time is ``ref_time``."""
    t = max(float(result.value), 1e-30)
    s = float(np.log(ref_time / t))
    if result.oom:
        return -1.0 - float(np.log(max(result.overflow, 1.0))) + min(0.0, s)
    return s


__all__ = ["plan_reward"]
