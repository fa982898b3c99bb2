"""Search placers over the full plan space: random search and simulated annealing (MCMC).

The space: every placement unit (a co-location class or a lone node) gets a device group (a single
device, or a group aligned with the topology's hierarchy) and a layout its members allow (single,
batch split, Megatron column/row split with a data-parallel degree, replicate); globally, microbatch
count, schedule (GPipe / 1F1B) and activation recomputation.

- :func:`random_search` samples plans (half of them structured: random contiguous stages, each with a
  random group and parallelism scheme; half unstructured: a random group and layout per unit) and keeps
  the best by the simulator (Bergstra & Bengio, "Random Search for Hyper-Parameter Optimization", JMLR
  2012, as the standard search baseline).
- :func:`mcmc` is FlexFlow's execution-optimiser search (Jia, Zaharia & Aiken, "Beyond Data and Model
  Parallelism for Deep Neural Networks", MLSys 2019, Sec. 5): Metropolis-Hastings over plans with the
  simulator as cost, started from the best fast heuristic. Moves: change one unit's group/layout;
  change a contiguous block of units (topological order) to one group and parallelism scheme; change
  the microbatch count, schedule, recomputation (none / selective / full), the ZeRO stage of the
  data-parallel nodes, or sequence parallelism on and off. A plan's ZeRO stage, selective
  recomputation, sequence splits and virtual stages carry over to its proposals (virtual stages while
  the moved placement's chunks still visit the pipeline ranks in turn). A proposal is accepted with probability
  ``min(1, exp(-(E' - E) / T))`` for energy ``E = log(objective value) + overflow penalty``; the temperature
  (:class:`Annealing`) ``T_k = T0 * 2^(-(k - k0) / HALF_LIFE)`` over the evaluation count ``k``, where
  ``k0`` is the last reheat: after ``STALL`` evaluations without a new best plan the chain is reheated
  (``k0 = k``). It depends only on the chain's own history, never on the budget, so for one seed a
  larger budget extends the same trajectory and is never worse.

Both are deterministic for a seed (numpy ``Generator(seed)``) under an evaluation budget; under a
wall-clock budget they follow the same trajectory and stop wherever the clock does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from agent.placers.common import (
    Budget,
    Outcome,
    PlacerError,
    Scorer,
    allowed_devices,
    divisors,
    finish,
    layout_ok,
    plan_defaults,
    units,
)
from envs.errors import PlanError
from envs.graph import OpGraph
from envs.plan import (
    Plan,
    expert_layers,
    interleaved_where_valid,
    megatron_layouts,
    recompute_flags,
    sequence_splittable,
)
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=60.0, evaluations=600)
T0 = 0.05
HALF_LIFE = 150.0
T_MIN = 1e-4
STALL = 1000  # evaluations without a new best plan before the chain is reheated (0: never)
OOM_PENALTY = 2.0


class PlanSpace:
    """The search space of the random and MCMC placers: candidate device groups and layouts of every
    placement unit of one (graph, topology), at ``global_batch`` (None: the graph's traced batch; a
    task's own batch carries over to every plan of the space, and microbatch counts divide it)."""

    def __init__(self, graph: OpGraph, topology: Topology, global_batch: int | None = None):
        self.graph, self.topology = graph, topology
        self.unit, self.members = units(graph)
        self.nu = len(self.members)
        allowed = allowed_devices(graph, topology)
        self.uallowed = np.array([allowed[m].all(axis=0) for m in self.members])
        groups = [(d,) for d in range(topology.num_devices)] + topology.hierarchy_groups()
        self.groups = list(dict.fromkeys(tuple(sorted(g)) for g in groups))
        self.mega = megatron_layouts(graph)
        self.kw = plan_defaults(graph)
        if global_batch is not None:
            self.kw["global_batch"] = int(global_batch)
        self.batch = int(global_batch) if global_batch is not None else graph.batch_size
        self.seq_ok = sequence_splittable(graph)
        self.expert_layer, _, self.expert_count = expert_layers(graph)
        self.moe_layers = sorted({int(x) for x in self.expert_layer if x >= 0})

    def expert_degrees(self, layer: int, dp: int) -> list[int]:
        """Expert-parallel degrees for an MoE layer whose experts have ``dp`` replicas: 1 and the powers
        of two dividing both dp and its experts."""
        e = int(self.expert_count[self.expert_layer == layer].max())
        return [k for k in divisors(math.gcd(dp, e)) if k & (k - 1) == 0]

    def keep_valid_experts(self, plan: Plan) -> Plan:
        """``plan`` with every MoE layer whose experts cannot stay expert-parallel after a move (their
        group, layout or neighbours changed) back to ep = 1 (and ZeRO off where one replica is left)."""
        if plan.ep.max(initial=1) <= 1:
            return plan
        for L in self.moe_layers:
            sel = self.expert_layer == L
            if plan.ep[sel].max() <= 1:
                continue
            trial = plan.ep.copy()
            trial[~sel] = 1
            try:
                plan.copy(ep=trial)._validate_expert_parallel(self.graph)
            except PlanError:
                plan.ep[sel] = 1
        plan.zero = np.where(plan.dp // plan.ep > 1, plan.zero, 0)
        return plan

    def unit_groups(self, u: int) -> list[tuple[int, ...]]:
        return [g for g in self.groups if self.uallowed[u, list(g)].all()]

    def unit_options(self, u: int, g: tuple[int, ...], scheme: str | None = None) -> list[tuple[str, int]]:
        """(layout, dp) options for unit ``u`` on group ``g`` (restricted to ``scheme`` if given:
        'batch', 'tensor', 'replicate')."""
        k = len(g)
        nodes = self.members[u].tolist()
        if k == 1:
            return [("single", 1)]
        opts: list[tuple[str, int]] = []
        if scheme in (None, "batch") and all(layout_ok(self.graph, v, "batch_split", k, k) for v in nodes):
            opts.append(("batch_split", k))
        if scheme in (None, "tensor", "replicate"):
            lays = ["replicate"] if scheme == "replicate" else list(dict.fromkeys(self.mega[v] for v in nodes))
            if scheme is None:
                lays = list(dict.fromkeys([*lays, "replicate"]))
            for lay in lays:
                for dp in divisors(k):
                    if dp == k and lay != "replicate":
                        continue
                    if all(layout_ok(self.graph, v, lay, k, dp) for v in nodes):
                        opts.append((lay, dp))
        return opts

    def assign(self, groups, layouts, dps, u: int, g: tuple[int, ...], lay: str, dp: int) -> None:
        for v in self.members[u].tolist():
            groups[v], layouts[v], dps[v] = g, lay, dp


def _mb_choices(batch: int) -> list[int]:
    return divisors(batch)


def random_plan(space: PlanSpace, rng: np.random.Generator) -> Plan:
    """One random plan from the search space (see module docstring)."""
    g_n = space.graph.num_nodes
    groups: list[tuple[int, ...]] = [()] * g_n
    layouts = ["single"] * g_n
    dps = np.ones(g_n, dtype=np.int64)
    ms = _mb_choices(space.batch)
    m = int(ms[rng.integers(len(ms))])
    structured = rng.random() < 0.5
    if structured:
        k = int(rng.integers(1, min(space.topology.num_devices, space.nu) + 1))
        cuts = np.sort(rng.choice(np.arange(1, space.nu), size=k - 1, replace=False)) if k > 1 else np.array([], int)
        bounds = [0, *cuts.tolist(), space.nu]
        for a, b in zip(bounds[:-1], bounds[1:]):
            scheme = ("batch", "tensor", "replicate")[int(rng.integers(3))]
            cand = space.unit_groups(a)
            g = cand[int(rng.integers(len(cand)))]
            dp_pick = None
            for u in range(a, b):
                gg = g if space.uallowed[u, list(g)].all() else space.unit_groups(u)[0]
                opts = space.unit_options(u, gg, scheme) or space.unit_options(u, gg) or [("single", 1)]
                if opts == [("single", 1)] and len(gg) > 1:
                    gg = (gg[0],)
                pick = opts[0] if dp_pick is None else min(opts, key=lambda o: abs(o[1] - dp_pick))
                if dp_pick is None:
                    pick = opts[int(rng.integers(len(opts)))]
                    dp_pick = pick[1]
                space.assign(groups, layouts, dps, u, gg, *pick)
    else:
        for u in range(space.nu):
            cand = space.unit_groups(u)
            g = cand[int(rng.integers(len(cand)))]
            opts = space.unit_options(u, g) or [("single", 1)]
            if opts == [("single", 1)] and len(g) > 1:
                g = (g[0],)
            space.assign(groups, layouts, dps, u, g, *opts[int(rng.integers(len(opts)))])
    rc = bool(rng.random() < 0.25)
    sched = ("1f1b", "gpipe")[int(rng.integers(2))]
    return Plan(groups=groups, layouts=layouts, dp=dps, microbatches=m, schedule=sched,
                recompute=np.full(g_n, rc), **space.kw)


def random_search(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                  objective: str = "step_time") -> Plan:
    """Random search (see module docstring) under ``budget`` (default 600 evaluations / 60 s)."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    space = PlanSpace(graph, topology)
    rng = np.random.default_rng(seed)
    best: tuple[Outcome, Plan] | None = None
    tries = 0
    while scorer.searching(tries):
        tries += 1
        plan = random_plan(space, rng)
        out = scorer(plan)
        if out is not None and (best is None or out.key() < best[0].key()):
            best = (out, plan)
    if best is None:
        raise PlacerError("random_search found no valid plan")
    return finish(best[1], "random_search", seed, scorer)


# ---------------------------------------------------------------------- MCMC
class Annealing:
    """The chain's temperature and Metropolis acceptance: ``T = max(t0 * 2^(-(k - k0) / half_life), T_MIN)``
    at evaluation ``k`` (``t0``, ``half_life``: MCMC's :data:`T0`, :data:`HALF_LIFE` unless given), reheated (``k0 = k``) after ``stall`` evaluations without a new best plan —
    simulated re-annealing (Ingber, "Very fast simulated re-annealing", Math. Comput. Modelling 12, 1989):
    a frozen chain on a long budget otherwise only descends greedily from the local minimum it is in.
    ``stall`` defaults to :data:`STALL` (measured: 1,000 evaluations beat 500 and never reheating over the
    agent benchmark's 15 cases x 2 seeds at 6,000 evaluations: 0.992 and 1.007 of the unreheated times;
    500 keeps a chain whose start is a strong local minimum too hot to ever descend below it)."""

    def __init__(self, stall: int | None = None, t0: float = T0, half_life: float = HALF_LIFE):
        if not (math.isfinite(t0) and t0 > 0 and math.isfinite(half_life) and half_life > 0):
            raise PlacerError(f"annealing needs a finite t0 > 0 and half_life > 0, got t0={t0}, half_life={half_life}")
        self.stall = STALL if stall is None else int(stall)
        self.t0, self.half_life = float(t0), float(half_life)
        self.k0 = 0  # the evaluation of the last reheat
        self.last_best = 0  # the evaluation of the last new best plan
        self.reheats = 0

    def temperature(self, k: int) -> float:
        return max(self.t0 * 2.0 ** (-(k - self.k0) / self.half_life), T_MIN)

    def accept(self, e: float, cur_e: float, k: int, rng: np.random.Generator) -> bool:
        """Metropolis: a proposal of energy ``e`` from ``cur_e`` after ``k`` evaluations (the chain is
        reheated first if it has stalled)."""
        if self.stall > 0 and k - max(self.k0, self.last_best) >= self.stall:
            self.k0, self.reheats = k, self.reheats + 1
        return e <= cur_e or rng.random() < math.exp(-(e - cur_e) / self.temperature(k))

    def new_best(self, k: int) -> None:
        """The chain found a new best plan at evaluation ``k``."""
        self.last_best = k


def energy(out: Outcome) -> float:
    e = math.log(max(out.value, 1e-30))
    if out.oom:
        e += OOM_PENALTY + 10.0 * max(0.0, out.overflow - 1.0)
    return e


def _recompute_mode(graph: OpGraph, rc: np.ndarray) -> str:
    if rc.all():
        return "full"
    if not rc.any():
        return "none"
    return "selective" if np.array_equal(rc, recompute_flags(graph, "selective")) else "custom"


def _propose(space: PlanSpace, plan: Plan, rng: np.random.Generator) -> Plan | None:
    graph = space.graph
    groups, layouts, dps = list(plan.groups), list(plan.layouts), plan.dp.copy()
    m, sched = plan.microbatches, plan.schedule
    recompute = plan.recompute.copy()
    zero = int(plan.zero.max()) if plan.zero.size else 0
    ep = plan.ep.copy()
    virtual = plan.virtual_stages  # kept while the chunks still visit the ranks in turn
    r = rng.random()
    if r < 0.4:  # one unit
        u = int(rng.integers(space.nu))
        cand = space.unit_groups(u)
        g = cand[int(rng.integers(len(cand)))]
        opts = space.unit_options(u, g)
        if not opts:
            return None
        space.assign(groups, layouts, dps, u, g, *opts[int(rng.integers(len(opts)))])
    elif r < 0.75:  # a contiguous block
        length = int(min(space.nu, 1 + rng.geometric(4.0 / max(space.nu, 4))))
        a = int(rng.integers(0, space.nu - length + 1))
        b = a + length
        if rng.random() < 0.5 and (a > 0 or b < space.nu):
            nb = a - 1 if (a > 0 and (b >= space.nu or rng.random() < 0.5)) else b
            v = int(space.members[nb][0])
            g = groups[v]
            scheme = {"batch_split": "batch", "replicate": "replicate"}.get(layouts[v], "tensor")
            dp_want = int(dps[v])
        else:
            cand = space.unit_groups(a)
            g = cand[int(rng.integers(len(cand)))]
            scheme = ("batch", "tensor", "replicate")[int(rng.integers(3))]
            dp_want = None
        for u in range(a, b):
            if not space.uallowed[u, list(g)].all():
                return None
            opts = space.unit_options(u, g, scheme) or space.unit_options(u, g)
            if not opts:
                return None
            if dp_want is None:
                dp_want = opts[int(rng.integers(len(opts)))][1]
            space.assign(groups, layouts, dps, u, g, *min(opts, key=lambda o: abs(o[1] - dp_want)))
    else:  # global knobs (only those that can change this plan)
        knobs = {"microbatches": 0.45, "schedule": 0.15, "recompute": 0.15}
        if (space.graph.param_bytes[dps > 1] > 0).any():
            knobs["zero"] = 0.15
        if "seq_split" in layouts or any(space.seq_ok[v] and len(groups[v]) // int(dps[v]) > 1 and x == "replicate"
                                         for v, x in enumerate(layouts)):
            knobs["sp"] = 0.10
        moe = [L for L in space.moe_layers if len(space.expert_degrees(L, int(dps[space.expert_layer == L].min()))) > 1]
        if moe:
            knobs["ep"] = 0.15
        names = list(knobs)
        w = np.array([knobs[k] for k in names])
        knob = names[int(rng.choice(len(names), p=w / w.sum()))]
        if knob == "microbatches":
            ms = _mb_choices(space.batch)
            i = ms.index(m) if m in ms else int(np.argmin([abs(x - m) for x in ms]))
            j = int(np.clip(i + (1 if rng.random() < 0.5 else -1), 0, len(ms) - 1))
            if j == i:
                return None
            m = ms[j]
        elif knob == "schedule":
            sched = "gpipe" if sched == "1f1b" else "1f1b"
            virtual = 1
        elif knob == "recompute":
            modes = [x for x in ("none", "selective", "full") if x != _recompute_mode(graph, recompute)]
            recompute = recompute_flags(graph, modes[int(rng.integers(len(modes)))])
        elif knob == "zero":
            zero = int(rng.choice([z for z in (0, 1, 2, 3) if z != zero]))
        elif knob == "ep":  # one MoE layer's expert-parallel degree
            L = moe[int(rng.integers(len(moe)))]
            sel = space.expert_layer == L
            degrees = [k for k in space.expert_degrees(L, int(dps[sel].min())) if k != int(ep[sel].max())]
            ep[sel] = degrees[int(rng.integers(len(degrees)))]
        else:  # sequence parallelism on / off
            if "seq_split" in layouts:
                layouts = ["replicate" if x == "seq_split" else x for x in layouts]
            else:
                layouts = ["seq_split" if x == "replicate" and space.seq_ok[v] and len(groups[v]) // int(dps[v]) > 1
                           else x for v, x in enumerate(layouts)]
    # a sequence split needs a tensor-parallel group: nodes moved off one go back to replicate
    layouts = ["replicate" if x == "seq_split" and len(groups[v]) // int(dps[v]) < 2 else x
               for v, x in enumerate(layouts)]
    plan = Plan(groups=groups, layouts=layouts, dp=dps, microbatches=m, schedule=sched, recompute=recompute,
                zero=np.where(dps // ep > 1, zero, 0), virtual_stages=1, ep=ep, **space.kw)
    return interleaved_where_valid(space.keep_valid_experts(plan), graph, virtual)


def initial_plan(graph: OpGraph, topology: Topology, objective: str, seed: int) -> Plan:
    """Best of the fast heuristics (single device, data parallel, GPipe split, a short Megatron
    enumeration, the pipeline DP, METIS), each with a fixed small evaluation budget."""
    from agent.placers.partition import metis
    from agent.placers.pipedream import pipedream
    from agent.placers.simple import data_parallel, single_device
    from agent.placers.templates import expert_split, megatron_3d

    best: Plan | None = None
    for fn, b in ((single_device, 12), (data_parallel, 12), (expert_split, 24), (megatron_3d, 48), (pipedream, 24),
                  (metis, 8)):
        try:
            p = fn(graph, topology, seed=seed, budget=Budget(evaluations=b), objective=objective)
        except PlacerError:
            continue
        pr = p.provenance
        key = (int(pr["oom"]), pr["predicted_step_time"])
        if best is None or key < (int(best.provenance["oom"]), best.provenance["predicted_step_time"]):
            best = p
    if best is None:
        raise PlacerError("no heuristic produced a starting plan")
    return best


def mcmc(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None, objective: str = "step_time",
         start: Plan | None = None, on_improve: Callable[[int, float], None] | None = None,
         t0: float = T0, half_life: float = HALF_LIFE) -> Plan:
    """Simulated annealing / MCMC over plans (see module docstring) under ``budget`` (default 600
    evaluations / 60 s, not counting the fixed-size heuristic runs that choose ``start``); ``on_improve``
    hears (evaluations so far, best value) at every improvement: the search curve. ``t0``, ``half_life``:
    the temperature schedule (:class:`Annealing`)."""
    anneal = Annealing(t0=t0, half_life=half_life)
    init = start if start is not None else initial_plan(graph, topology, objective, seed)
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET), on_improve=on_improve)
    space = PlanSpace(graph, topology, init.global_batch)
    rng = np.random.default_rng(seed)
    cur = init.copy(provenance={})
    cur_out = scorer(cur)
    if cur_out is None:
        raise PlacerError("mcmc: the starting plan is not valid")
    cur_e = energy(cur_out)
    best, best_out = cur, cur_out
    accepted = proposals = 0
    while scorer.searching(proposals):
        proposals += 1
        cand = _propose(space, cur, rng)
        if cand is None:
            continue
        out = scorer(cand)
        if out is None:
            continue
        e = energy(out)
        if anneal.accept(e, cur_e, scorer.evaluations, rng):
            cur, cur_out, cur_e = cand, out, e
            accepted += 1
        if out.key() < best_out.key():
            best, best_out = cand, out
            anneal.new_best(scorer.evaluations)
    return finish(best, "mcmc", seed, scorer, start=init.provenance.get("placer", "given"),
                  start_step_time=init.provenance.get("predicted_step_time"), accepted=accepted,
                  reheats=anneal.reheats, saturated=scorer.saturated())
