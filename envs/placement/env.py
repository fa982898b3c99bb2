"""``rlplace/Placement-v0``: place an operator graph on a device topology, one decision per step.

**Episode (mode ``"place"``).** A task (graph, topology, batch) is drawn at every ``reset``. Graphs
larger than ``max_nodes`` are coarsened to at most ``max_nodes`` groups (``envs.coarsen``); the agent
places groups and ``info["plan"]`` is expanded back to operators. The episode first decides the global
parallelism choices, then one option per node group:

1. number of microbatches (action i -> ``microbatch_choices[i]``; only divisors of the batch allowed),
2. pipeline schedule (0 = GPipe, 1 = 1F1B),
3. activation recomputation (0 = none, 1 = full, for every node),
4. for each node in a fixed order, an option (device group, layout) from the task's option table
   (:class:`envs.placement.options.OptionTable`: every single device, and every group of
   ``topology.hierarchy_groups()`` with batch_split / col_split / row_split / replicate).

All phases share one ``Discrete(max_options)`` action space; ``action_masks()`` (and the ``action_mask``
observation key) says which actions are meaningful now. An action outside the mask is replaced by
the ``action % k``-th allowed action (so random actions from ``action_space.sample()`` are safe) and
``info["invalid_action"]`` is set.

**Order.** ``order="topological"`` (default) decides nodes in topological order: every producer is
placed before its consumers, so the dynamic features (``node_devices``, ``option_state`` locality)
show where the node's inputs live when it is decided — the sequential decision then mirrors how the
simulator forms pipeline stages (first use in topological order), and co-located groups are pinned
as soon as their first member is placed. ``order="critical_path"`` sorts by descending upward rank
(HEFT), which is also a topological order but decides the heaviest chains first so that they get
the free devices (meant for graphs with wide parallel branches: MoE, Inception; not yet shown to
train better).

**Masks.** An option is hidden when its layout is not allowed for the node (layout capabilities,
AND-ed over the node's co-location class; dp > 1 needs batch splitting), when its data-parallel
degree does not divide the microbatch, when the node's co-location class is already placed elsewhere
(it must follow), or when the model states already placed on a member device plus this node's (its
class's) would certainly exceed that device's memory. If memory rules out every option, the memory
rule is dropped for that node (the plan will be OOM and penalised), so an episode never dead-ends.

**Reward.** Intermediate rewards are 0; at the end :func:`envs.placement.reward.plan_reward`:
``log(T_ref / T_plan)`` where ``T_ref`` is the better (non-OOM first) of the single-device and the full
data-parallel plan (computed once per task and cached); an OOM plan gets
``-1 - log(peak / capacity) on the worst device + min(0, log(T_ref / T_plan))`` — below -1, growing with
the overflow, and never above the same plan's time reward, so fitting in memory always pays.
No shaping is used (none was tried). The evaluator (default :class:`envs.evaluator.CachedSimulation`,
cached by ``plan.key()``) evaluates plans on the (coarse) graph the agent sees; ``eval_graph="fine"``
evaluates the expanded plan on the operator graph instead.

**Mode ``"refine"``** (Placeto-style): the episode starts from a complete plan — the best-rewarded of
the single-device, data-parallel and Megatron tensor-parallel plans expressible in the option table
(``refine_init``), whose global choices stay fixed — and revisits every node ``refine_passes`` times in
the same order; each step re-assigns one node (its co-location class moves with it) and is rewarded
with the improvement ``plan_reward(new) - plan_reward(prev)`` (``= log(T_prev / T_new)`` while both fit),
so the return telescopes to ``plan_reward(final) - plan_reward(initial)``.

**Observation**: the flat Dict declared in :mod:`envs.placement.observation` — static per-task arrays
(node / edge / device / option features, pairwise bandwidth and latency, masks) computed once, and
dynamic arrays (assignment, node being decided, device load and memory, per-option state, phase,
global choices, ``action_mask``) updated incrementally; every step returns fresh copies.

Per-task work (everything that does not change during an episode) is :mod:`envs.placement.task_setup`'s,
cached per task object; this module only runs episodes.

``reset(options={"task": task})`` places a given task instead of drawing one (e.g. for evaluation).

**info**: ``task_id``, ``phase``, ``num_groups`` on every step; at the end also ``step_time``,
``ref_time``, ``ref_plan``, ``score`` (the plan's reward), ``peak_memory`` (per device), ``memory_capacity``,
``oom``, ``plan`` (a :class:`envs.plan.Plan` on operators), ``plan_json`` (its dict) and ``group_plan``
(the plan on groups); in refine mode every step also carries ``score``, ``step_time`` and ``oom`` of the
current plan, and the last step ``best_plan``, ``best_step_time``, ``best_oom`` and ``best_score``: the
best plan any step of the episode visited (every one was evaluated), which a search keeps even when
later steps undo it.

**Bad input** (graph above ``max_nodes`` with ``coarsen=False``, a topology with more than
``max_devices`` devices, more options than ``max_options``, more edges than ``max_edges``, no
microbatch choice dividing the batch, model states that exceed the memory of all devices together
or a node that fits on no device) raises :class:`envs.errors.EnvError` at construction for listed tasks,
and at the reset that draws it for a sampler's task (the first draw is probed at construction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np

from envs.errors import EnvError, RlplaceError
from envs.evaluator import CachedSimulation, EvalResult, PlanEvaluator
from envs.graph import OpGraph
from envs.placement.observation import PHASES, DynamicState, globals_width, observation_space
from envs.placement.options import ORDERS
from envs.placement.reward import plan_reward
from envs.placement.task_setup import PreparedTask, Scoring, Settings, prepare_task, reference, refine_start
from envs.plan import SCHEDULES, Plan
from envs.sim import OBJECTIVES
from envs.tasks import Task, default_tasks

MODES = ("place", "refine")
REFINE_INITS = ("best", "single_device", "data_parallel", "megatron")
N_GLOBAL_PHASES = 3


class PlacementEnv(gym.Env):
    """Sequential placement of a graph's node groups on a topology (see the module docstring)."""

    metadata = {"render_modes": []}

    def __init__(self, tasks: Sequence[Task] | Callable[[np.random.Generator], Task] | None = None, *,
                 max_nodes: int = 64, max_devices: int = 8, max_edges: int | None = None,
                 max_options: int | None = None, mode: str = "place", objective: str = "step_time",
                 evaluator: PlanEvaluator | None = None, coarsen: bool = True, coarsen_method: str = "auto",
                 order: str = "topological", microbatch_choices: Sequence[int] = (1, 2, 4, 8),
                 refine_passes: int = 1, refine_init: str = "best", eval_graph: str = "coarse",
                 seed: int | None = None, task_cache_size: int = 64):
        super().__init__()
        if mode not in MODES:
            raise EnvError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if order not in ORDERS:
            raise EnvError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
        if objective not in OBJECTIVES:
            raise EnvError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if refine_init not in REFINE_INITS:
            raise EnvError(f"unknown refine_init {refine_init!r}; choose one of {', '.join(REFINE_INITS)}")
        if eval_graph not in ("coarse", "fine"):
            raise EnvError("eval_graph must be 'coarse' or 'fine'")
        if int(max_nodes) < 1 or int(max_devices) < 1:
            raise EnvError("max_nodes and max_devices must be >= 1")
        self.max_nodes = int(max_nodes)
        self.max_devices = int(max_devices)
        self.max_edges = int(max_edges) if max_edges is not None else 4 * self.max_nodes
        # option table bound: singles + at most ~2D hierarchy groups x 4 layouts
        self.max_options = int(max_options) if max_options is not None else 9 * self.max_devices
        self.microbatch_choices = tuple(int(m) for m in microbatch_choices)
        if not self.microbatch_choices or min(self.microbatch_choices) < 1:
            raise EnvError("microbatch_choices must be positive integers")
        if self.max_options < max(len(self.microbatch_choices), len(SCHEDULES), 2):
            raise EnvError(f"max_options={self.max_options} is smaller than the global phases' choices")
        self.mode = mode
        self.objective = objective
        self.evaluator: PlanEvaluator = evaluator if evaluator is not None else CachedSimulation()
        self.coarsen = bool(coarsen)
        self.coarsen_method = coarsen_method
        self.order = order
        self.refine_passes = max(1, int(refine_passes))
        self.refine_init = refine_init
        self.eval_graph = eval_graph
        self._settings = Settings(max_nodes=self.max_nodes, max_edges=self.max_edges, max_devices=self.max_devices,
                                  max_options=self.max_options, microbatch_choices=self.microbatch_choices,
                                  objective=objective, coarsen=self.coarsen, coarsen_method=coarsen_method,
                                  order=order)
        self._scoring = Scoring(self.evaluator, objective, fine=eval_graph == "fine")
        self._placer = f"rlplace-env/{mode}"
        self._init_seed = seed
        self._seeded = False
        self._cache: OrderedDict[int, PreparedTask] = OrderedDict()
        self._cache_size = max(1, int(task_cache_size))

        if tasks is None:
            tasks = default_tasks()
        if callable(tasks) and not isinstance(tasks, (list, tuple)):
            self._sampler: Callable[[np.random.Generator], Task] | None = tasks
            self._tasks: list[Task] = []
            probe = tasks(np.random.default_rng(seed))
            self._prepare(probe)  # fail at construction on a bad first task
        else:
            self._sampler = None
            self._tasks = list(tasks)
            if not self._tasks:
                raise EnvError("PlacementEnv needs at least one task")
            for t in self._tasks:
                self._prepare(t)

        self.n_globals = globals_width(len(self.microbatch_choices))
        self.observation_space = observation_space(self.max_nodes, self.max_edges, self.max_devices,
                                                   self.max_options, self.n_globals)
        self.action_space = gym.spaces.Discrete(self.max_options)
        self._dyn = DynamicState(self.max_nodes, self.max_devices, self.max_options, len(self.microbatch_choices))
        self._p: PreparedTask | None = None
        self._mask = np.zeros(self.max_options, dtype=bool)

    def _prepare(self, task: Task) -> PreparedTask:
        """The task's preparation, from the per-task cache (keyed by the task object)."""
        key = id(task)
        hit = self._cache.get(key)
        if hit is not None and hit.task is task:
            self._cache.move_to_end(key)
            return hit
        p = prepare_task(task, self._settings)
        self._cache[key] = p
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return p

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and not self._seeded and self._init_seed is not None:
            seed = self._init_seed
        super().reset(seed=seed)
        self._seeded = True
        options = options or {}
        if "task" in options:
            task = options["task"]
        elif self._sampler is not None:
            task = self._sampler(self.np_random)
        else:
            task = self._tasks[int(self.np_random.integers(len(self._tasks)))]
        p = self._prepare(task)
        self._p = p
        n, nd = p.graph.num_nodes, p.task.topology.num_devices
        self._n, self._nd = n, nd
        self._assign = np.full(n, -1, dtype=np.int64)
        self._dev_states = np.zeros(nd)
        self._dev_load = np.zeros(nd)
        self._dev_count = np.zeros(nd)
        self._class_opt = np.full(len(p.class_members), -1, dtype=np.int64)
        self._total_time = max(float(p.time_single.sum()), 1e-30)
        self._dyn.reset()
        self._t = 0
        self._ref = reference(p, self._scoring)
        if self.mode == "place":
            self._mb_idx, self._sched, self._recompute = -1, -1, -1
            self._horizon = N_GLOBAL_PHASES + n
        else:
            start = refine_start(p, self._scoring, self.refine_init, self.microbatch_choices, self._placer)
            self._mb_idx, self._sched, self._recompute = start.mb_idx, SCHEDULES.index("1f1b"), 0
            for v in range(n):
                self._put(v, int(start.assign[v]))
            self._reward_now = start.reward
            self._horizon = n * self.refine_passes
            self._best_visit = None
        self._write_globals()
        self._prepare_decision()
        return self._obs(), self._info()

    def step(self, action):
        if self._p is None:
            raise RlplaceError("call reset() before step()")
        if self._t >= self._horizon:
            raise RlplaceError("episode is over; call reset()")
        a = int(action)
        info_extra = {}
        if not (0 <= a < self.max_options and self._mask[a]):
            allowed = np.flatnonzero(self._mask)
            a = int(allowed[a % allowed.size]) if 0 <= a else int(allowed[0])
            info_extra["invalid_action"] = True
        p = self._p
        reward = 0.0
        phase = self._phase()
        if phase == 0:
            self._mb_idx = a
        elif phase == 1:
            self._sched = a
        elif phase == 2:
            self._recompute = a
        else:
            v = self._node()
            c = int(p.class_of[v])
            targets = p.class_members[c] if (self.mode == "refine" and c >= 0) else (v,)
            for u in targets:
                u = int(u)
                if self._assign[u] >= 0:
                    self._take(u)
                self._put(u, a)
            if self.mode == "place" and c >= 0 and self._class_opt[c] < 0:
                self._class_opt[c] = a
        self._t += 1
        done = self._t >= self._horizon
        if self.mode == "refine" or done:
            self._write_globals()
        final = None
        if self.mode == "refine":
            res = self._scoring.evaluate(p, self._current_plan())
            s = plan_reward(res, self._ref["time"])
            reward = s - self._reward_now
            self._reward_now = s
            final = (res, s)
            info_extra.update({"score": s, "step_time": float(res.value), "oom": bool(res.oom)})
            key = (bool(res.oom), float(res.value))
            if self._best_visit is None or key < self._best_visit[0]:
                self._best_visit = (key, self._assign.copy(), res)
        elif done:
            res = self._scoring.evaluate(p, self._current_plan())
            s = plan_reward(res, self._ref["time"])
            reward = s
            final = (res, s)
        elif phase < N_GLOBAL_PHASES:
            self._write_globals()
        if not done:
            self._prepare_decision()
        else:
            self._dyn.set_done()
            self._mask.fill(False)
            self._mask[0] = True
        info = self._info()
        info.update(info_extra)
        if done:
            res, s = final
            plan, full = self._plans_of(self._assign, res)
            info.update({"step_time": float(res.value), "ref_time": self._ref["time"],
                         "ref_plan": self._ref["plan"], "score": s, "peak_memory": res.peak_memory.copy(),
                         "memory_capacity": res.memory_capacity.copy(), "oom": bool(res.oom), "plan": full,
                         "plan_json": full.to_dict(), "group_plan": plan})
            if self.mode == "refine":
                info.update(self._best_visited())
        return self._obs(), float(reward), bool(done), False, info

    def action_masks(self) -> np.ndarray:
        """Bool mask over the Discrete(max_options) actions (sb3-contrib's MaskablePPO protocol)."""
        return self._mask.copy()

    # ------------------------------------------------------------------ the episode's state
    def _phase(self) -> int:
        if self.mode == "refine":
            return N_GLOBAL_PHASES
        return min(self._t, N_GLOBAL_PHASES)

    def _node(self) -> int:
        k = self._t - N_GLOBAL_PHASES if self.mode == "place" else self._t % self._n
        return int(self._p.order[k])

    def _put(self, v: int, o: int) -> None:
        p = self._p
        self._assign[v] = o
        row = p.dev_f[o]
        self._dev_states += row * (p.states[v] / p.options.state_div[o])
        self._dev_load += row * (p.time_single[v] * np.exp2(float(p.speed[v, o])))
        self._dev_count += row
        self._dyn.set_assignment(v, o, int(p.options.layout[o]), len(p.options.groups[o]) / self._nd, p.dev_frac[o])

    def _take(self, v: int) -> None:
        p = self._p
        o = int(self._assign[v])
        row = p.dev_f[o]
        self._dev_states -= row * (p.states[v] / p.options.state_div[o])
        self._dev_load -= row * (p.time_single[v] * np.exp2(float(p.speed[v, o])))
        self._dev_count -= row
        self._assign[v] = -1

    def _prepare_decision(self) -> None:
        """Mask and per-option features for the decision at step ``self._t``."""
        p, dyn = self._p, self._dyn
        phase = self._phase()
        dyn.set_phase(phase)
        mask = self._mask
        mask.fill(False)
        if phase == 0:
            mask[:len(self.microbatch_choices)] = p.mb_valid
            dyn.set_current(-1)
            dyn.option_state.fill(0)
        elif phase in (1, 2):
            mask[:2] = True
            dyn.set_current(-1)
            dyn.option_state.fill(0)
        else:
            v = self._node()
            dyn.set_current(v)
            k = p.options.size
            c = int(p.class_of[v])
            cur = int(self._assign[v])
            used = self._dev_states
            if self.mode == "refine":  # the node's (class's) own states do not count against it
                used = used.copy()
                for u in (p.class_members[c] if c >= 0 else (v,)):
                    o = int(self._assign[u])
                    used -= p.dev_f[o] * (p.states[u] / p.options.state_div[o])
            ok = p.allowed[v] & p.mb_ok[self._mb_idx]
            need = p.need[v] / p.options.state_div
            headroom = p.capacity - used
            min_head = (p.dev_inf + headroom[None, :]).min(axis=1)
            fit = need <= min_head
            forced = self.mode == "place" and c >= 0 and self._class_opt[c] >= 0
            if forced:
                mask[int(self._class_opt[c])] = True
            else:
                sel = ok & fit
                mask[:k] = sel if sel.any() else ok
                if self.mode == "refine" and cur >= 0:
                    mask[cur] = True
            # per-option features for this node
            st = dyn.option_state
            after = (used[None, :] + need[:, None] * p.dev_f) / p.capacity[None, :]
            st[:k, 0] = np.minimum((after * p.dev_f).max(axis=1), 16.0)
            st[:k, 1] = p.speed[v] / 4.0
            srcs, b = p.preds[v]
            if srcs.size and p.in_bytes[v] > 0:
                placed = self._assign[srcs] >= 0
                if placed.any():
                    loc_dev = (b[placed, None] * p.dev_frac[self._assign[srcs[placed]]]).sum(axis=0)
                    st[:k, 2] = p.dev_f @ loc_dev / p.in_bytes[v]
                else:
                    st[:k, 2] = 0
            else:
                st[:k, 2] = 0
        dyn.action_mask[:] = mask
        ds = dyn.device_state
        nd = self._nd
        ds[:nd, 0] = np.minimum(self._dev_load / self._total_time, 16.0)
        ds[:nd, 1] = np.minimum(self._dev_states / p.capacity, 16.0)
        ds[:nd, 2] = self._dev_count / self._n

    def _write_globals(self) -> None:
        self._dyn.set_globals(self._mb_idx, self._sched, self._recompute, self._t / max(self._horizon, 1))

    # ------------------------------------------------------------------ plans and outputs
    def _best_visited(self) -> dict:
        """Refine mode: the best plan any step of this episode produced (``best_*`` info keys)."""
        (oom, step_time), assign, res = self._best_visit
        return {"best_plan": self._plans_of(assign, res)[1], "best_step_time": step_time, "best_oom": oom,
                "best_score": plan_reward(res, self._ref["time"])}

    def _plans_of(self, assign: np.ndarray, res: EvalResult) -> tuple[Plan, Plan]:
        """(plan on groups, plan on operators with the evaluation in its provenance) of an assignment."""
        plan = self._assignment_plan(assign)
        full = self._p.expand(plan)
        full.provenance.update({"predicted_step_time": float(res.value), "objective": self.objective,
                                "predicted_peak_memory": [float(x) for x in res.peak_memory]})
        return plan, full

    def _assignment_plan(self, assign: np.ndarray) -> Plan:
        return self._p.plan(assign, self.microbatch_choices[self._mb_idx], SCHEDULES[self._sched],
                            bool(self._recompute), self._placer)

    def _current_plan(self) -> Plan:
        return self._assignment_plan(self._assign)

    def _obs(self) -> dict[str, np.ndarray]:
        obs = {k: a.copy() for k, a in self._p.static.items()}  # fresh arrays: callers may keep them
        obs.update(self._dyn.arrays())
        return obs

    def _info(self) -> dict:
        return {"task_id": self._p.task.name, "phase": PHASES[self._phase()] if self._t < self._horizon else "done",
                "num_groups": self._n}

    # ------------------------------------------------------------------ public views of the episode
    @property
    def prepared(self) -> PreparedTask | None:
        """The current episode's prepared task (None before the first reset)."""
        return self._p

    @property
    def task(self) -> Task | None:
        return None if self._p is None else self._p.task

    @property
    def graph(self) -> OpGraph | None:
        """The graph the agent places in the current episode (coarse if coarsened)."""
        return None if self._p is None else self._p.graph

    @property
    def phase(self) -> int | None:
        """The index into :data:`envs.placement.observation.PHASES` of the decision now, or None when no
        decision is pending (before the first reset, after the last step)."""
        if self._p is None or self._t >= self._horizon:
            return None
        return self._phase()

    @property
    def node(self) -> int | None:
        """The node group decided now (the ``place`` phase), else None."""
        return self._node() if self.phase == N_GLOBAL_PHASES else None

    def show_assignment(self, assign: np.ndarray, node: int, globals_: tuple[int, int, int] | None = None
                        ) -> dict[str, np.ndarray]:
        """Refine mode: the observation of the complete plan ``assign`` (one option per group) with group
        ``node`` being decided, and ``globals_`` = (microbatch choice index, schedule index, recompute)
        if given; :meth:`action_masks` is then that decision's mask. For a search that asks the policy
        about plans it did not reach by stepping; the episode's rewards are stale afterwards, so
        ``reset`` before stepping again."""
        if self.mode != "refine" or self._p is None:
            raise RlplaceError("show_assignment needs a refine-mode environment after reset()")
        a = np.asarray(assign, dtype=np.int64)
        if a.shape != (self._n,) or a.min() < 0 or a.max() >= self._p.options.size:
            raise EnvError(f"show_assignment: need {self._n} option ids below {self._p.options.size}")
        for v in np.flatnonzero(a != self._assign).tolist():
            self._take(v)
            self._put(v, int(a[v]))
        if globals_ is not None:
            self._mb_idx, self._sched, self._recompute = (int(x) for x in globals_)
        self._t = int(np.flatnonzero(self._p.order == int(node))[0])
        self._write_globals()
        self._prepare_decision()
        return self._obs()

    @property
    def current_plan_reward(self) -> float | None:
        """Refine mode: the reward of the current (complete) plan; None in place mode."""
        return self._reward_now if self.mode == "refine" and self._p is not None else None

    def reference(self) -> dict:
        """The current task's reference plans and times (``time`` is T_ref)."""
        return dict(reference(self._p, self._scoring))


__all__ = ["PlacementEnv", "MODES", "REFINE_INITS"]
