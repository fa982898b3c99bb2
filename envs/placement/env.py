"""``rlplace/Placement-v0``: place an operator graph on a device topology, one decision per step.

**Episode (mode ``"place"``).** A task (graph, topology, batch) is drawn at every ``reset``. Graphs
larger than ``max_nodes`` are coarsened to at most ``max_nodes`` groups (``envs.coarsen``); the agent
places groups and ``info["plan"]`` is the plan on the task's operators. The episode decides:

1. the number of microbatches (action i -> the divisor of the batch nearest to ``microbatch_choices[i]``,
   ``envs.placement.task_setup.microbatch_counts``; choices standing for the same count are hidden),
2. the pipeline schedule (0 = GPipe, 1 = 1F1B),
3. for each node in a fixed order, an *action* = a placement (device group, layout, dp, tp) from the
   task's placement table times a modifier (ZeRO stage, recomputation none / selective / full, expert
   parallelism): :mod:`envs.placement.options`,
4. when the plan allows interleaving (a 1F1B pipeline whose chunks can visit its ranks in turn), the
   number of virtual stages (action i -> ``VIRTUAL_STAGE_CHOICES[i]``); otherwise the episode ends after
   the last node.

All decisions share one ``Discrete(max_options x modifiers)`` action space; ``action_masks()`` (and the
``action_mask`` observation key) says which actions are meaningful now. An action outside the mask is
replaced by the ``action % k``-th allowed action (so random actions from ``action_space.sample()`` are
safe) and ``info["invalid_action"]`` is set.

**Order.** ``order="topological"`` (default) decides nodes in topological order: every producer is
placed before its consumers, so the dynamic features (``node_devices``, ``option_state`` locality)
show where the node's inputs live when it is decided — the sequential decision then mirrors how the
simulator forms pipeline stages (first use in topological order), and co-located groups are pinned
as soon as their first member is placed. ``order="critical_path"`` sorts by descending upward rank
(HEFT), which is also a topological order but decides the heaviest chains first.

**Masks.** A placement is hidden when its layout is not allowed for the node (layout capabilities,
AND-ed over the node's co-location class; dp > 1 needs batch splitting; ``seq_split`` needs ops that
may be sequence-split), when its data-parallel degree does not divide the microbatch, or when the
node's co-location class is already placed elsewhere (it must follow). A modifier is hidden where it
does not apply: ZeRO without data parallelism or parameters, selective recomputation without attention-
core ops, expert parallelism without experts, batch splitting or a dp sharing a factor with the experts. An action
is also hidden when the model states already placed on a member device plus this node's (its class's,
under the modifier's ZeRO stage) would certainly exceed that device's memory; if memory rules out every
action, the memory rule is dropped for that node (the plan will be OOM and penalised), so an episode
never dead-ends.

**Reward.** Intermediate rewards are 0; at the end :func:`envs.placement.reward.plan_reward`:
``log(T_ref / T_plan)`` where ``T_ref`` is the better (non-OOM first) of the single-device and the full
data-parallel plan (computed once per task and cached); an OOM plan gets
``-1 - log(peak / capacity) on the worst device + min(0, log(T_ref / T_plan))`` — below -1, growing with
the overflow, and never above the same plan's time reward, so fitting in memory always pays.
The evaluator (default :class:`envs.evaluator.CachedSimulation`, cached by ``plan.key()``) evaluates
the plan on the task's operator graph (``eval_graph="fine"``, the default: exact, and the only graph on
which a group's selective recomputation is expressible); ``eval_graph="coarse"`` evaluates the plan
projected onto the groups instead (faster, approximate: a group's selective recomputation counts as
full when most of its ops are recomputed).

**Mode ``"refine"``** (Placeto-style): the episode starts from a complete plan — the best-rewarded of
the single-device, data-parallel and Megatron tensor x data plans expressible in the placement table
(``refine_init``) — and revisits the microbatch count, the schedule, every node ``refine_passes`` times in
the same order (its co-location class moves with it) and the virtual stages; each step is rewarded with
the improvement ``plan_reward(new) - plan_reward(prev)`` (``= log(T_prev / T_new)`` while both fit), so
the return telescopes to ``plan_reward(final) - plan_reward(initial)``. A microbatch count the current
placements cannot split over is hidden. The best plan visited (``info["best_plan"]``) counts the start
too. With ``evaluate_steps=False`` (fast inference) only the last step's plan is simulated: its reward
is the whole improvement, and the best plan visited is the better of the start and the final plan.

**Observation**: the flat Dict declared in :mod:`envs.placement.observation` — static per-task arrays
(node / edge / device / placement / modifier features, pairwise bandwidth and latency, masks) computed
once, and dynamic arrays (assignment, node being decided, device load and memory, per-placement and
per-action state, phase, global choices, ``action_mask``) updated incrementally; every step returns
fresh copies.

Per-task work (everything that does not change during an episode) is :mod:`envs.placement.task_setup`'s,
cached per task object; this module only runs episodes.

``reset(options={"task": task})`` places a given task instead of drawing one (e.g. for evaluation); in
refine mode ``options={"start": plan}`` starts the episode from that plan as the action table expresses
it (e.g. a heuristic's plan, for a policy-guided improvement of it), and ``options={"start": "runner-up"}``
from the best template start that places the groups otherwise than the usual start (that start when
there is none): a better start does not always give a better episode (a 10-GPU series-parallel DAG:
from METIS's 8 parts, 15.11 ms, the policy finds no improving move; from m-ETF's schedule, 15.55 ms, it
reaches 14.30 ms), so ``agent.infer.place`` spreads its samples over both.

**info**: ``task_id``, ``phase``, ``num_groups`` on every step; at the end also ``step_time``,
``ref_time``, ``ref_plan``, ``score`` (the plan's reward), ``peak_memory`` (per device), ``memory_capacity``,
``oom``, ``plan`` (a :class:`envs.plan.Plan` on operators), ``plan_json`` (its dict) and ``group_plan``
(the plan projected on the groups); in refine mode every step also carries ``score``, ``step_time`` and
``oom`` of the current plan, and the last step ``best_plan``, ``best_step_time``, ``best_oom`` and
``best_score``: the best plan the episode visited (the start or any step's; every one was evaluated),
which a search keeps even when later steps undo it.

**Bad input** (graph above ``max_nodes`` with ``coarsen=False``, a topology with more than
``max_devices`` devices, more placements than ``max_options``, more edges than ``max_edges``, no
microbatch choice dividing the batch, model states that exceed the memory of all devices together
or a node that fits on no device) raises :class:`envs.errors.EnvError` at construction for listed tasks,
and at the reset that draws it for a sampler's task (the first draw is probed at construction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace

import gymnasium as gym
import numpy as np

from envs.errors import EnvError, RlplaceError
from envs.evaluator import CachedSimulation, EvalResult, PlanEvaluator
from envs.graph import OpGraph
from envs.placement.observation import (
    GLOBAL_CHOICES,
    MICROBATCH_CHOICES,
    PHASES,
    VIRTUAL_STAGE_CHOICES,
    DynamicState,
    globals_width,
    observation_space,
)
from envs.placement.options import (
    COMM_FACTOR,
    EXPERT_ROWS,
    N_MODIFIERS,
    ORDERS,
    ZERO_ROWS,
    expert_parallel_degree,
    option_bound,
)
from envs.placement.reward import plan_reward
from envs.placement.task_setup import (
    PreparedTask,
    RefineStart,
    Scoring,
    Settings,
    express,
    prepare_task,
    reference,
    refine_start,
)
from envs.plan import LAYOUTS, SCHEDULES, Plan, interleaved_where_valid
from envs.sim import OBJECTIVES
from envs.tasks import Task, default_tasks

MODES = ("place", "refine")
REFINE_INITS = ("best", "single_device", "data_parallel", "megatron")
RUNNER_UP = "runner-up"  # reset(options={"start": RUNNER_UP}): the best start placed otherwise (module docstring)
MB, SCHED, PLACE, VS = (PHASES.index(p) for p in ("microbatches", "schedule", "place", "virtual_stages"))
N_LEADING_PHASES = 2  # the microbatch count and the schedule come before the nodes
BATCH_SPLIT = LAYOUTS.index("batch_split")


class PlacementEnv(gym.Env):
    """Sequential placement of a graph's node groups on a topology (see the module docstring)."""

    metadata = {"render_modes": []}

    def __init__(self, tasks: Sequence[Task] | Callable[[np.random.Generator], Task] | None = None, *,
                 max_nodes: int = 64, max_devices: int = 8, max_edges: int | None = None,
                 max_options: int | None = None, mode: str = "place", objective: str = "step_time",
                 evaluator: PlanEvaluator | None = None, coarsen: bool = True, coarsen_method: str = "auto",
                 order: str = "topological", microbatch_choices: Sequence[int] = MICROBATCH_CHOICES,
                 refine_passes: int = 1, refine_init: str = "best", eval_graph: str = "fine",
                 evaluate_steps: bool = True, seed: int | None = None, task_cache_size: int = 64):
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
        self.max_options = int(max_options) if max_options is not None else option_bound(self.max_devices)
        self.microbatch_choices = tuple(int(m) for m in microbatch_choices)
        if not self.microbatch_choices or min(self.microbatch_choices) < 1:
            raise EnvError("microbatch_choices must be positive integers")
        if len(self.microbatch_choices) > GLOBAL_CHOICES:
            raise EnvError(f"at most {GLOBAL_CHOICES} microbatch choices, got {len(self.microbatch_choices)}")
        if self.max_options < 1:
            raise EnvError("max_options must be >= 1")
        self.mode = mode
        self.objective = objective
        self.evaluator: PlanEvaluator = evaluator if evaluator is not None else CachedSimulation()
        self.coarsen = bool(coarsen)
        self.coarsen_method = coarsen_method
        self.order = order
        self.refine_passes = max(1, int(refine_passes))
        self.refine_init = refine_init
        self.eval_graph = eval_graph
        self.evaluate_steps = bool(evaluate_steps)
        self._settings = Settings(max_nodes=self.max_nodes, max_edges=self.max_edges, max_devices=self.max_devices,
                                  max_options=self.max_options, microbatch_choices=self.microbatch_choices,
                                  objective=objective, coarsen=self.coarsen, coarsen_method=coarsen_method,
                                  order=order)
        self._scoring = Scoring(self.evaluator, objective, fine=eval_graph == "fine")
        self._placer = f"rlplace-env/{mode}"
        self._init_seed = seed
        self._seeded = False
        self._shown: tuple | None = None  # (assignment bytes, globals) whose loads show_assignment last built
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
        self.n_actions = self.max_options * N_MODIFIERS
        self.action_space = gym.spaces.Discrete(self.n_actions)
        self._dyn = DynamicState(self.max_nodes, self.max_devices, self.max_options, len(self.microbatch_choices))
        self._p: PreparedTask | None = None
        self._mask = np.zeros(self.n_actions, dtype=bool)

    def _prepare(self, task: Task) -> PreparedTask:
        """The task's preparation, from the per-task cache (keyed by the task object)."""
        key = id(task)
        hit = self._cache.get(key)
        if hit is not None and hit.task is task:
            self._cache.move_to_end(key)
            return hit
        p = self._prepared(task)
        self._cache[key] = p
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return p

    def _prepared(self, task: Task) -> PreparedTask:
        """:func:`prepare_task`; in refine mode on ``auto`` groups, of those and the groups that also keep
        concurrent children apart (``envs.coarsen``'s ``concurrent`` and ``concurrent-chains``: an HRNet's
        resolution branches, an ensemble's members), the one whose refine start simulates faster (the
        earlier of auto, concurrent, concurrent-chains on a tie). Keeping children apart takes groups
        from elsewhere: a random series-parallel graph's 384 operators lose their layout-pure groups
        (Megatron's pipeline x tensor-parallel start 625 ms -> 659 ms), an HRNet gains (35 ms -> 21 ms).
        The two light merges after the split suit different graphs (two 8-A100 nodes): ordered neighbours
        first keeps an ensemble's members apart (40 groups: its best start 6.51 ms vs 9.01 ms along chain
        edges), chain edges first puts an HRNet's resampling convolutions beside the sum they feed (128
        groups: 20.51 ms vs 20.82 ms; at 40 groups the ordered merge's start is the faster, 21.9 ms vs 27.9)."""
        if self.mode != "refine" or self.coarsen_method != "auto":
            return prepare_task(task, self._settings)
        split = prepare_task(task, replace(self._settings, coarsen_method="concurrent"))
        if split.grouping is None or split.grouping.method == "auto":
            return split  # no child kept apart (nor an ordered merge that differs): auto's groups
        splits = [split]
        chains = prepare_task(task, replace(self._settings, coarsen_method="concurrent-chains"))
        if chains.grouping.method != "auto" and not np.array_equal(chains.grouping.group_of, split.grouping.group_of):
            splits.append(chains)
        best, best_key = None, None
        for q in (prepare_task(task, self._settings), *splits):
            start = refine_start(q, self._scoring, self.refine_init, self.microbatch_choices, self._placer)
            key = (bool(start.result.oom), float(start.result.value))
            if best_key is None or key < best_key:
                best, best_key = q, key
        return best

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and not self._seeded and self._init_seed is not None:
            seed = self._init_seed
        super().reset(seed=seed)
        self._seeded = True
        self._shown = None
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
        self._dev_acts = np.zeros(nd)
        self._dev_load = np.zeros(nd)
        self._dev_count = np.zeros(nd)
        self._class_opt = np.full(len(p.class_members), -1, dtype=np.int64)
        self._total_time = max(float(p.time_single.sum()), 1e-30)
        self._batch_scale = p.task.global_batch / max(int(p.task.graph.batch_size), 1)
        self._min_cap = (p.capacity[None, :] + p.dev_inf).min(axis=1)
        self._dyn.reset()
        self._t = 0
        self._vs_choices: list[int] = [0]
        self._ref = reference(p, self._scoring)
        self._node_steps = n if self.mode == "place" else n * self.refine_passes
        self._horizon = N_LEADING_PHASES + self._node_steps + 1  # the virtual-stage decision may be skipped
        if self.mode == "place":
            self._mb_idx, self._sched, self._vs = -1, -1, -1
        else:
            given = options.get("start")
            if isinstance(given, str) and given != RUNNER_UP:
                raise EnvError(f"reset's start must be a Plan or {RUNNER_UP!r}, got {given!r}")
            if given is None or given == RUNNER_UP:
                start = refine_start(p, self._scoring, self.refine_init, self.microbatch_choices, self._placer)
                start = (p.runner_up or start) if given == RUNNER_UP else start
            else:
                start = self._given_start(given)
            self._mb_idx, self._sched, self._vs = start.mb_idx, start.schedule, start.vs
            for v in range(n):
                self._put(v, int(start.assign[v]))
            self._reward_now = start.reward
            self._best_visit = ((bool(start.result.oom), float(start.result.value)), start.assign.copy(),
                                self._globals(), start.result)
        self._write_globals()
        self._prepare_decision()
        return self._obs(), self._info()

    def _given_start(self, plan: Plan) -> RefineStart:
        """Refine mode, ``reset(options={"start": plan})``: the episode starts from ``plan`` (on the task's
        operators or on the groups) as the action table expresses it (``task_setup.express``), with the
        valid microbatch count nearest to the plan's that its placements can split and the plan's schedule."""
        p = self._p
        assign = express(p, plan)
        for mem in p.class_members:
            assign[mem] = assign[mem[0]]
        ok = p.mb_valid & p.mb_ok[:, assign // N_MODIFIERS].all(axis=1)
        if not ok.any():
            ok = p.mb_valid & (p.mb_counts == 1)
        mb_idx = p.nearest_microbatch_choice(plan.microbatches, ok)
        sched = SCHEDULES.index(plan.schedule) if plan.schedule in SCHEDULES else SCHEDULES.index("1f1b")
        res = self._scoring.evaluate(p, p.plan(assign, int(p.mb_counts[mb_idx]), SCHEDULES[sched], 1, self._placer))
        return RefineStart(name="given", assign=assign, reward=plan_reward(res, self._ref["time"]), mb_idx=mb_idx,
                           result=res, schedule=sched)

    def step(self, action):
        if self._p is None:
            raise RlplaceError("call reset() before step()")
        if self._t >= self._horizon:
            raise RlplaceError("episode is over; call reset()")
        self._shown = None
        a = int(action)
        info_extra = {}
        if not (0 <= a < self.n_actions and self._mask[a]):
            allowed = np.flatnonzero(self._mask)
            a = int(allowed[a % allowed.size]) if 0 <= a else int(allowed[0])
            info_extra["invalid_action"] = True
        p = self._p
        reward = 0.0
        phase = self._phase()
        if phase == MB:
            self._mb_idx = a
            self._reload()  # the activations in flight depend on the microbatches
        elif phase == SCHED:
            self._sched = a
            self._reload()
        elif phase == VS:
            self._vs = a
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
        if self._t == N_LEADING_PHASES + self._node_steps:  # the nodes are decided: interleave?
            self._vs_choices = self._valid_virtual_stages()
            if len(self._vs_choices) == 1:
                self._vs = self._vs_choices[0]
                self._horizon = self._t
        done = self._t >= self._horizon
        self._write_globals()
        final = None
        if self.mode == "refine" and (self.evaluate_steps or done):
            res = self._scoring.evaluate(p, self._current_plan())
            s = plan_reward(res, self._ref["time"])
            reward = s - self._reward_now
            self._reward_now = s
            final = (res, s)
            info_extra.update({"score": s, "step_time": float(res.value), "oom": bool(res.oom)})
            key = (bool(res.oom), float(res.value))
            if key < self._best_visit[0]:
                self._best_visit = (key, self._assign.copy(), self._globals(), res)
        elif done:
            res = self._scoring.evaluate(p, self._current_plan())
            s = plan_reward(res, self._ref["time"])
            reward = s
            final = (res, s)
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
            plan = self._plan_of(self._assign, self._globals(), res)
            info.update({"step_time": float(res.value), "ref_time": self._ref["time"],
                         "ref_plan": self._ref["plan"], "score": s, "peak_memory": res.peak_memory.copy(),
                         "memory_capacity": res.memory_capacity.copy(), "oom": bool(res.oom), "plan": plan,
                         "plan_json": plan.to_dict(), "group_plan": p.coarse_plan(plan)})
            if self.mode == "refine":
                info.update(self._best_visited())
        return self._obs(), float(reward), bool(done), False, info

    def action_masks(self) -> np.ndarray:
        """Bool mask over the Discrete(max_options x modifiers) actions (sb3-contrib's MaskablePPO protocol)."""
        return self._mask.copy()

    # ------------------------------------------------------------------ the episode's state
    def _phase(self) -> int:
        if self._t < N_LEADING_PHASES:
            return (MB, SCHED)[self._t]
        return PLACE if self._t < N_LEADING_PHASES + self._node_steps else VS

    def _node(self) -> int:
        k = self._t - N_LEADING_PHASES
        return int(self._p.order[k % self._n])

    def _act_scale(self) -> float:
        """Activations of one traced batch -> stashed on a device: the microbatch's share of the batch times
        the microbatches in flight (all under GPipe; at most one per device under 1F1B)."""
        m = int(self._p.mb_counts[self._mb_idx]) if self._mb_idx >= 0 else 1
        in_flight = m if self._sched == SCHEDULES.index("gpipe") else min(m, self._nd)
        return self._batch_scale / m * in_flight

    def _loads(self, v: int, a: int) -> tuple[int, float, float, float]:
        """(placement, model states, activations, compute time) a node adds on each member device."""
        p = self._p
        o, k = divmod(a, N_MODIFIERS)
        states = p.states[v] / p.options.state_div[o] * p.state_factor(v)[o, k]
        acts = p.act_kept[v, k] * self._act_scale() / p.act_div[o]
        load = p.time_single[v] * np.exp2(float(p.speed[v, o]) + float(p.time_factor[v, k]))
        return o, states, acts, load

    def _put(self, v: int, a: int) -> None:
        p = self._p
        self._assign[v] = a
        o, states, acts, load = self._loads(v, a)
        row = p.dev_f[o]
        self._dev_states += row * states
        self._dev_acts += row * acts
        self._dev_load += row * load
        self._dev_count += row
        self._dyn.set_assignment(v, o, int(p.options.layout[o]), a % N_MODIFIERS, len(p.options.groups[o]) / self._nd,
                                 p.dev_frac[o])

    def _take(self, v: int) -> None:
        p = self._p
        o, states, acts, load = self._loads(v, int(self._assign[v]))
        row = p.dev_f[o]
        self._dev_states -= row * states
        self._dev_acts -= row * acts
        self._dev_load -= row * load
        self._dev_count -= row
        self._assign[v] = -1

    def _reload(self) -> None:
        """Recompute the per-device loads of the placed nodes (after a global choice changed)."""
        placed = np.flatnonzero(self._assign >= 0)
        for arr in (self._dev_states, self._dev_acts, self._dev_load, self._dev_count):
            arr.fill(0.0)
        for v in placed.tolist():
            a = int(self._assign[v])
            self._put(v, a)

    def _prepare_decision(self) -> None:
        """Mask and per-action features for the decision at step ``self._t``."""
        p, dyn = self._p, self._dyn
        phase = self._phase()
        dyn.set_phase(phase)
        mask = self._mask
        mask.fill(False)
        if phase != PLACE:
            dyn.set_current(-1)
            dyn.option_state.fill(0)
            dyn.action_state.fill(0)
            if phase == MB:
                ok = p.mb_valid.copy()
                if self.mode == "refine":  # the current placements must split every microbatch
                    placed = self._assign[self._assign >= 0] // N_MODIFIERS
                    ok &= p.mb_ok[:, placed].all(axis=1)
                    ok[self._mb_idx] = True
                mask[:len(self.microbatch_choices)] = ok
            elif phase == SCHED:
                mask[:len(SCHEDULES)] = True
            else:
                mask[self._vs_choices] = True
        else:
            self._prepare_node_decision(self._node())
        dyn.action_mask[:] = mask
        ds = dyn.device_state
        nd = self._nd
        ds[:nd, 0] = np.minimum(self._dev_load / self._total_time, 16.0)
        ds[:nd, 1] = np.minimum(self._dev_states / p.capacity, 16.0)
        ds[:nd, 2] = np.minimum(self._dev_acts / p.capacity, 16.0)
        ds[:nd, 3] = self._dev_count / self._n

    def _prepare_node_decision(self, v: int) -> None:
        """The mask over (placement, modifier) and the option / action features for node ``v``."""
        p, dyn, mask = self._p, self._dyn, self._mask
        opts = p.options
        P = opts.size
        c = int(p.class_of[v])
        cur = int(self._assign[v])
        used, acts = self._dev_states, self._dev_acts
        if self.mode == "refine":  # the node's (class's) own loads do not count against it
            used, acts = used.copy(), acts.copy()
            for u in (p.class_members[c] if c >= 0 else (v,)):
                if self._assign[u] >= 0:
                    o, st, ac, _ = self._loads(int(u), int(self._assign[u]))
                    used -= p.dev_f[o] * st
                    acts -= p.dev_f[o] * ac
        place_ok = p.allowed[v] & p.mb_ok[self._mb_idx]
        ok = place_ok[:, None] & p.modifier_ok[v][None, :]
        ok &= ~(ZERO_ROWS[None, :] & (opts.dp < 2)[:, None])
        experts = int(p.stats.expert_count[v])
        ep_place = (opts.layout == BATCH_SPLIT) & (opts.dp >= 2) & (expert_parallel_degree(opts.dp, experts) >= 2)
        ok &= ~(EXPERT_ROWS[None, :] & ~ep_place[:, None])
        need = p.need[v] / opts.state_div[:, None] * p.state_factor(v)  # [P, K] model states per member
        headroom = (p.dev_inf + (p.capacity - used)[None, :]).min(axis=1)
        fit = need <= headroom[:, None]
        forced = self.mode == "place" and c >= 0 and self._class_opt[c] >= 0
        flat = mask[:P * N_MODIFIERS].reshape(P, N_MODIFIERS)
        if forced:
            mask[int(self._class_opt[c])] = True
        else:
            sel = ok & fit
            flat[:] = sel if sel.any() else ok
            if self.mode == "refine" and cur >= 0:
                mask[cur] = True
        dyn.set_current(v)
        # per-placement features (no modifier)
        st = dyn.option_state
        after = (used[None, :] + (p.need[v] / opts.state_div)[:, None] * p.dev_f) / p.capacity[None, :]
        st[:P, 0] = np.minimum((after * p.dev_f).max(axis=1), 16.0)
        st[:P, 1] = p.speed[v] / 4.0
        srcs, b = p.preds[v]
        st[:P, 2] = 0
        if srcs.size and p.in_bytes[v] > 0:
            placed = self._assign[srcs] >= 0
            if placed.any():
                src_place = self._assign[srcs[placed]] // N_MODIFIERS
                loc_dev = (b[placed, None] * p.dev_frac[src_place]).sum(axis=0)
                st[:P, 2] = p.dev_f @ loc_dev / p.in_bytes[v]
        # per-action features: memory after (states + activations, the fullest member), compute factor
        busiest = ((used + acts)[None, :] - p.dev_inf).max(axis=1)
        act_add = p.act_kept[v][None, :] * self._act_scale() / p.act_div[:, None]
        ast = dyn.action_state
        mem = np.minimum((busiest[:, None] + need + act_add) / self._min_cap[:, None], 16.0)
        ast[:P, :, 0] = mem
        ast[:P, :, 1] = np.maximum(mem - 1.0, 0.0)
        ast[:P, :, 2] = p.time_factor[v][None, :]
        ast[:P, :, 3] = np.where(opts.dp[:, None] > 1, COMM_FACTOR[None, :], 0.0)

    def _globals(self) -> tuple[int, int, int]:
        return self._mb_idx, self._sched, self._vs

    def _write_globals(self) -> None:
        self._dyn.set_globals(self._mb_idx, self._sched, self._vs, self._t / max(self._horizon, 1))

    def _valid_virtual_stages(self) -> list[int]:
        """The virtual-stage choices (indices into VIRTUAL_STAGE_CHOICES) the complete plan allows."""
        base = self._plan_for(self._assign, (self._mb_idx, self._sched, 0))
        ok = [0]
        if base.schedule != "1f1b":
            return ok
        graph = self._p.task.graph
        return ok + [i for i, v in enumerate(VIRTUAL_STAGE_CHOICES[1:], start=1)
                     if interleaved_where_valid(base, graph, v).virtual_stages == v]

    # ------------------------------------------------------------------ plans and outputs
    def _plan_for(self, assign: np.ndarray, globals_: tuple[int, int, int]) -> Plan:
        """The plan of ``assign`` with the global choices; interleaved only while the placements are chunked
        as interleaving needs (an episode from an interleaved start moves groups before it decides the
        virtual stages again at its end)."""
        mb, sched, vs = globals_
        plan = self._p.plan(assign, int(self._p.mb_counts[max(mb, 0)]), SCHEDULES[sched if sched >= 0 else 1],
                            VIRTUAL_STAGE_CHOICES[max(vs, 0)], self._placer)
        return interleaved_where_valid(plan, self._p.task.graph, plan.virtual_stages)

    def _current_plan(self) -> Plan:
        return self._plan_for(self._assign, self._globals())

    def _plan_of(self, assign: np.ndarray, globals_: tuple[int, int, int], res: EvalResult) -> Plan:
        """The plan on operators of an assignment, with the evaluation in its provenance."""
        plan = self._plan_for(assign, globals_)
        plan.provenance.update({"predicted_step_time": float(res.value), "objective": self.objective,
                                "predicted_peak_memory": [float(x) for x in res.peak_memory]})
        return plan

    def _best_visited(self) -> dict:
        """Refine mode: the best plan any step of this episode produced (``best_*`` info keys)."""
        (oom, step_time), assign, globals_, res = self._best_visit
        return {"best_plan": self._plan_of(assign, globals_, res), "best_step_time": step_time, "best_oom": oom,
                "best_score": plan_reward(res, self._ref["time"])}

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
        return self._node() if self.phase == PLACE else None

    @property
    def assignment(self) -> np.ndarray:
        """The current action of every group (-1: not placed yet)."""
        return self._assign.copy()

    @property
    def global_choices(self) -> tuple[int, int, int]:
        """(microbatch choice index, schedule index, virtual-stage choice index); -1: not decided yet."""
        return self._globals()

    def show_assignment(self, assign: np.ndarray, node: int, globals_: tuple[int, int, int] | None = None,
                        dynamic_only: bool = False) -> dict[str, np.ndarray]:
        """Refine mode: the observation of the complete plan ``assign`` (one action per group) with group
        ``node`` being decided, and ``globals_`` = (microbatch choice index, schedule index, virtual-stage
        choice index) if given; :meth:`action_masks` is then that decision's mask. For a search that asks
        the policy about plans it did not reach by stepping; the episode's rewards are stale afterwards,
        so ``reset`` before stepping again. ``dynamic_only``: only the
        :data:`~envs.placement.observation.DYNAMIC_KEYS` arrays (a caller that holds the static ones)."""
        if self.mode != "refine" or self._p is None:
            raise RlplaceError("show_assignment needs a refine-mode environment after reset()")
        a = np.asarray(assign, dtype=np.int64)
        if a.shape != (self._n,) or a.min() < 0 or a.max() >= self._p.num_actions:
            raise EnvError(f"show_assignment: need {self._n} action ids below {self._p.num_actions}")
        if globals_ is not None:
            shown = (a.tobytes(), tuple(int(x) for x in globals_))
            if shown != self._shown:  # the loads of the plan last shown are still in place otherwise
                self._mb_idx, self._sched, self._vs = shown[1]
                self._assign[:] = a
                self._reload()
                self._shown = shown
        else:
            self._shown = None
            for v in np.flatnonzero(a != self._assign).tolist():
                self._take(v)
                self._put(v, int(a[v]))
        self._t = N_LEADING_PHASES + int(np.flatnonzero(self._p.order == int(node))[0])
        self._write_globals()
        self._prepare_decision()
        return self._dyn.arrays() if dynamic_only else self._obs()

    @property
    def current_plan_reward(self) -> float | None:
        """Refine mode: the reward of the current (complete) plan; None in place mode."""
        return self._reward_now if self.mode == "refine" and self._p is not None else None

    def reference(self) -> dict:
        """The current task's reference plans and times (``time`` is T_ref)."""
        return dict(reference(self._p, self._scoring))


__all__ = ["PlacementEnv", "MODES", "REFINE_INITS", "N_LEADING_PHASES"]
