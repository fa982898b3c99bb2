"""Policy-guided search: simulated annealing whose moves the placement policy proposes.

:func:`guided_search` anneals over plans on the *operator* graph exactly as ``agent.placers.search.mcmc``
does (same energy, the same Metropolis acceptance and re-annealing, ``agent.placers.search.Annealing``,
the same caching :class:`agent.placers.common.Scorer` and its evaluation count), but it starts cooler
(:data:`T0`, :data:`HALF_LIFE`: see there) and a fraction ``policy_fraction`` of the proposals comes from the policy instead of
``agent.placers.search._propose``:

1. **The policy's view of the current plan.** The plan is expressed as one action (placement x
   modifier) per coarse group the policy places (``task_setup.express``: each group takes its members'
   majority choice); the refine-mode environment then shows that complete plan with one group "being
   decided" (:meth:`envs.placement.env.PlacementEnv.show_assignment`) — the observation a refine episode
   would see when it revisits that group.
2. **Which group to change.** A *round* draws ``groups_per_round`` groups uniformly (without
   replacement) and scores all of them in one batched forward pass (the static graph embeddings are
   computed once per search). Each group's weight is the policy's probability mass on options *other
   than* the group's current one (``1 - p(current)``): a group the policy is content with is rarely
   touched, one it would move is proposed often. Uniform pre-sampling keeps a round's cost fixed
   (one forward pass of ``groups_per_round`` rows, a few simulator evaluations' worth on 500 groups)
   instead of scoring every group after every accepted move, and still lets every group be chosen.
   The env's visiting order was not used: it spends proposals on groups in a fixed sweep whatever the
   policy thinks of them.
3. **Which action.** The policy's distribution for that group, renormalised over the actions other
   than the current one; the move gives every operator of the group (and of its co-location class)
   that action's devices, layout, data-parallel degree, ZeRO stage, recomputation and expert
   parallelism, as ``PreparedTask.plan`` would (``PreparedTask.apply_action``), and keeps every other
   operator of the plan as it is.

A round ends after ``groups_per_round`` proposals or when an ordinary MCMC move changes the plan. An
accepted policy move does not end it: the round goes on with the other groups' distributions, computed
one move ago (the moved group's class is dropped), so one forward pass serves several accepted moves.
Measured (``experiments/bench_search.py``, 15 cases x 2 seeds at 4,000 evaluations): the same results
as ending the round at every accepted move (geometric mean 0.999 of its times, the same 24 of 29 rows
matching MCMC; the seeds' median spread is 0.25%) at about half the cost per evaluation (series-parallel
DAG 4.5 -> 2.3 ms, t5 6.2 -> 3.1 ms), so ``place``'s time budget buys about twice the evaluations.

While the current plan stays, a group is scored once (later rounds reuse its distribution) and a move
is proposed once: the moves are drawn
without replacement from the policy's distribution at that plan, remembered for the last
``UNTRIED_PLANS`` plans, as annealing keeps returning to plans it left. A policy move that would
re-create a plan the search has already scored is skipped (a near-deterministic policy otherwise
re-proposes the same moves, spending the budget on cache hits), and a round with nothing new left
gives an ordinary MCMC move instead — except at ``policy_fraction=1``, where every move stays a
policy move (expert iteration's searches rely on it: every plan they visit is one the environment
expresses). Measured in ``rlplace place``'s 20 s on a 24-operator chain (``mlp-chain@pcie-4gpu``):
without the memory and the fallback, about 15 rebuilt moves and one re-scored round per new plan held
the search to 840 evaluations; with them it makes 6,066. The remaining ``1 - policy_fraction`` of the
proposals are ``_propose``'s (block moves, microbatches, schedule, recomputation, ZeRO, sequence
parallelism: the global knobs the refine policy never changes), so the chain can reach every plan
plain MCMC can; with ``policy_fraction=0`` it *is* ``mcmc``'s trajectory for the same seed and schedule.

Deterministic for a seed under an evaluation budget (one ``numpy`` Generator draws groups, options,
the proposal kind and acceptances; the network runs without sampling). The result is never worse than
the start plan (the start is the first best). Evaluations are the Scorer's: every simulation of a new
plan on the operator graph (the start plan's included); the few coarse-graph simulations the refine environment makes at
reset (its reference and start plans) are reported apart (``setup_evaluations``, at most five, on the
coarse graph), so an evaluation budget is exact.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from agent.placers.common import Budget, Outcome, Scorer, finish
from agent.placers.search import Annealing, PlanSpace, _propose, energy
from envs.errors import RlplaceError
from envs.evaluator import CachedSimulation, EvalResult
from envs.graph import OpGraph
from envs.placement.observation import VIRTUAL_STAGE_CHOICES
from envs.plan import SCHEDULES, Plan
from envs.topology import Topology

POLICY_FRACTION = 0.7  # share of proposals drawn from the policy (the rest: ordinary MCMC moves)
# the annealing schedule: the search starts from the best of the policy's and the heuristics' plans, so it
# starts cooler than MCMC from a heuristic (T0 0.05, half-life 150 evaluations). Measured with
# experiments/bench_agent.py's (b) cases, 15 x seeds 0 and 1 from place's start: at 1/10 of MCMC's
# 15-second evaluations, MCMC's 15-second value reached on 24 of 30 runs (21 with MCMC's schedule; T0 0.01
# at half-life 150: 23, T0 0.003: 22), geometric mean of the values 0.992 of it (1.004); at place's own
# evaluation counts, MCMC at equal evaluations matched on 28 of 30 (25), 0.983 of its values (0.986).
# MCMC itself from the best heuristic does worse with this schedule (1.006 of its values, twotower#0 1.11)
T0 = 0.01
HALF_LIFE = 50.0
GROUPS_PER_ROUND = 32  # groups scored by one batched forward pass
UNTRIED_PLANS = 256  # plans whose scored groups and tried moves the proposer remembers


class GuidedSearchError(RlplaceError):
    """A guided search cannot run: a bad budget or fraction, or a start plan that is not valid."""


@dataclass
class GuidedResult:
    """What :func:`guided_search` found and what it cost."""

    plan: Plan  # the best plan (provenance stamped by ``agent.placers.common.finish``)
    value: float
    oom: bool
    evaluation: EvalResult
    evaluations: int  # simulator evaluations of plans on the operator graph (what the budget counts)
    setup_evaluations: int = 0  # the refine environment's coarse-graph simulations at reset (<= 5)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (evaluations, best value so far)
    seconds: float = 0.0
    policy_proposals: int = 0
    mcmc_proposals: int = 0
    accepted: int = 0
    note: str = ""  # why the policy was not used, when it was not
    saturated: bool = False  # stopped early: its last proposals found no plan it had not scored (Scorer.saturated)


# ---------------------------------------------------------------------- the policy's proposals
class PolicyProposer:
    """Draws moves (group, option) for the current operator plan from a policy's refine-mode distribution."""

    def __init__(self, model, graph: OpGraph, topology: Topology, objective: str, max_groups: int | None,
                 groups_per_round: int = GROUPS_PER_ROUND, uniform: bool = False, global_batch: int | None = None):
        import torch as th

        from agent.infer import padding_sizes, policy_env, trim_to
        from envs.placement.observation import STATIC_KEYS
        from envs.tasks import Task

        self.model, self.graph, self.uniform = model, graph, bool(uniform)
        self.coarse_eval = CachedSimulation(cache_size=64)
        task = Task(graph, topology, global_batch)
        self.env, _, _ = policy_env(model, task, objective, max_groups, self.coarse_eval, episode={"mode": "refine"})
        first, _ = self.env.reset(options={"task": task})
        self.prep = self.env.prepared
        self.n = self.prep.graph.num_nodes
        self.k = int(groups_per_round)
        self.fe = model.policy.features_extractor
        self.sizes = padding_sizes(first)  # the task's unpadded axis sizes (static: the same for every plan)
        self.static = {k: th.as_tensor(v)[None] for k, v in trim_to(first, self.sizes, STATIC_KEYS).items()}
        with th.no_grad():
            self.dev_s, self.node_s = self.fe.static_embeddings(self.static)
        self.assign = np.zeros(self.n, dtype=np.int64)
        self.globals = (0, 1, 0)
        # per group, the policy's distribution at the current plan over its allowed actions other than the
        # current one, (action ids, probabilities), a tried action's probability zeroed: a group is scored
        # once per plan and a move proposed once from it (sampling without replacement); kept for the
        # last UNTRIED_PLANS plans, as annealing returns to plans it left
        self.untried: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.untried_at: OrderedDict[bytes, dict[int, tuple[np.ndarray, np.ndarray]]] = OrderedDict()
        self.round: list[tuple[int, np.ndarray, np.ndarray]] = []  # this round's groups with untried moves

    @property
    def coarse_evaluations(self) -> int:
        """Simulations the refine environment made (its reference and start plans)."""
        return self.coarse_eval.misses

    # ------------------------------------------------------------------ the plan as the policy sees it
    def sync(self, plan: Plan, plan_digest: bytes | None = None) -> None:
        """Take ``plan`` (on operators) as the current plan (``plan_digest``: its :func:`digest`, if known);
        the round's distributions are dropped."""
        from envs.placement.task_setup import express

        p = self.prep
        self.assign = express(p, plan)
        for mem in p.class_members:
            self.assign[mem] = self.assign[mem[0]]
        vs = plan.virtual_stages
        self.globals = (self.prep.nearest_microbatch_choice(plan.microbatches),
                        SCHEDULES.index(plan.schedule) if plan.schedule in SCHEDULES else 1,
                        VIRTUAL_STAGE_CHOICES.index(vs) if vs in VIRTUAL_STAGE_CHOICES else 0)
        self._plan_changed(digest(plan) if plan_digest is None else plan_digest)

    def _plan_changed(self, plan_digest: bytes) -> None:
        """The current plan has :func:`digest` ``plan_digest`` (``self.assign`` and ``self.globals``: its
        coarse view)."""
        self.round = []
        key = plan_digest + self.assign.tobytes() + np.asarray(self.globals, dtype=np.int64).tobytes()
        if key in self.untried_at:
            self.untried_at.move_to_end(key)
        else:
            self.untried_at[key] = {}
            if len(self.untried_at) > UNTRIED_PLANS:
                self.untried_at.popitem(last=False)
        self.untried = self.untried_at[key]

    def distributions(self, groups: list[int]) -> list[np.ndarray]:
        """The policy's masked softmax over actions for each of ``groups`` in the current plan (with
        ``uniform``, the ablation: every allowed action equally likely, no forward pass)."""
        import torch as th

        from agent.infer import trim_to
        from envs.placement.observation import DYNAMIC_KEYS

        rows, masks = [], []
        for v in groups:
            obs = self.env.show_assignment(self.assign, v, self.globals, dynamic_only=True)
            rows.append(trim_to(obs, self.sizes, DYNAMIC_KEYS))
            masks.append(self.env.action_masks())
        if self.uniform:
            return [m / m.sum() for m in (mask.astype(np.float64) for mask in masks)]
        b = len(rows)
        batch = {k: th.as_tensor(np.stack([r[k] for r in rows])) for k in rows[0]}
        batch.update({k: v.expand(b, *v.shape[1:]) for k, v in self.static.items()})
        with th.no_grad():
            logits = self.fe.logits_from_embeddings(batch, self.dev_s.expand(b, -1, -1),
                                                    self.node_s.expand(b, -1, -1))[0].numpy().astype(np.float64)
        out = []
        for lg, m in zip(logits, masks):
            lg = np.where(m[:lg.size], lg, -np.inf)
            p = np.exp(lg - lg.max())
            out.append(p / p.sum())
        return out

    # ------------------------------------------------------------------ proposals
    def new_round(self, rng: np.random.Generator) -> None:
        """Draw ``groups_per_round`` groups uniformly, score those not scored at this plan yet (one batched
        forward pass); keep those with an untried move."""
        groups = sorted(rng.choice(self.n, size=min(self.k, self.n), replace=False).tolist())
        fresh = [v for v in groups if v not in self.untried]
        for v, p in zip(fresh, self.distributions(fresh) if fresh else []):
            other = p.copy()
            other[self.assign[v]] = 0.0
            ids = np.flatnonzero(other)
            self.untried[v] = (ids, other[ids])
        self.round = [(v, *self.untried[v]) for v in groups if self.untried[v][1].sum() > 0]

    def propose(self, plan: Plan, rng: np.random.Generator,
                seen: set[bytes]) -> tuple[Plan | None, tuple[int, int] | None]:
        """A plan with one group moved to an action drawn from the policy's untried moves at this plan,
        and the move; a move whose plan is in ``seen`` (already simulated or invalid) is drawn again, as
        it would tell nothing. ``(None, None)`` when the round runs out."""
        if not self.round:
            self.new_round(rng)
        while self.round:
            w = np.array([p.sum() for _, _, p in self.round])
            i = int(rng.choice(len(self.round), p=w / w.sum()))
            v, ids, p = self.round.pop(i)
            j = int(rng.choice(p.size, p=p / p.sum()))
            p[j] = 0.0  # proposed once from this plan
            o = int(ids[j])
            cand = self.apply(plan, v, o)
            if cand is not None and digest(cand) not in seen:
                return cand, (v, o)
        return None, None

    def apply(self, plan: Plan, v: int, a: int) -> Plan | None:
        """``plan`` with group ``v``'s operators (and its class's) on action ``a``; None if unchanged."""
        c = int(self.prep.class_of[v])
        groups = self.prep.class_members[c] if c >= 0 else [v]
        new = self.prep.apply_action(plan, groups, a)
        return None if new.key() == plan.key() else new

    def accepted(self, move: tuple[int, int], plan_digest: bytes) -> None:
        """The policy's move was accepted: the current plan (:func:`digest` ``plan_digest``) is the
        assignment with it. The round goes on with its other groups' distributions (copies: the plan
        left keeps its own memory of what was tried there)."""
        v, o = move
        c = int(self.prep.class_of[v])
        moved = set(self.prep.class_members[c] if c >= 0 else [v])
        self.assign[list(moved)] = o
        rest = [(u, ids, p.copy()) for u, ids, p in self.round if u not in moved]
        self._plan_changed(plan_digest)
        self.round = rest


# ---------------------------------------------------------------------- the search
def guided_search(model, graph: OpGraph, topology: Topology, objective: str, start: Plan, *, seed: int = 0,
                  seconds: float | None = None, evaluations: int | None = None,
                  policy_fraction: float = POLICY_FRACTION, groups_per_round: int = GROUPS_PER_ROUND,
                  max_groups: int | None = None, evaluator: CachedSimulation | None = None,
                  uniform_moves: bool = False, t0: float = T0, half_life: float = HALF_LIFE) -> GuidedResult:
    """Simulated annealing from ``start`` with policy-proposed moves (see the module docstring), until
    ``seconds`` of wall clock or ``evaluations`` simulator evaluations are spent (at least one given).
    ``max_groups``: the coarse groups the policy sees (default: the policy's padding). ``evaluator``:
    the caching evaluator to share (e.g. ``place``'s). ``uniform_moves``: an ablation, the same group
    moves with every allowed option equally likely instead of the policy's distribution. ``t0``,
    ``half_life``: the temperature schedule (``agent.placers.search.Annealing``; a value that is not a finite
    number > 0 raises its ``PlacerError``)."""
    budget = _budget(seconds, evaluations, policy_fraction, groups_per_round)
    anneal = Annealing(t0=t0, half_life=half_life)
    began = time.perf_counter()
    scorer = Scorer(graph, topology, objective, budget)
    if evaluator is not None:
        scorer.evaluator = evaluator  # the caller's cache; the Scorer still counts only new simulations
    rng = np.random.default_rng(seed)
    cur = start.copy(provenance={})
    cur_out = scorer(cur)
    if cur_out is None:
        raise GuidedSearchError("guided search: the start plan is not valid for this graph and topology")
    proposer, note = _proposer(model, graph, topology, objective, max_groups, groups_per_round, policy_fraction,
                               uniform_moves, start.global_batch)
    seen: set[bytes] = set()  # digests of the plans scored so far (the policy does not propose them again)
    if proposer is not None:
        proposer.sync(cur)
        seen.add(digest(cur))
    space = PlanSpace(graph, topology, start.global_batch)
    best, best_out, cur_e = cur, cur_out, energy(cur_out)
    curve = [(scorer.evaluations, best_out.value)]
    counts = {"policy": 0, "mcmc": 0, "accepted": 0}
    tries = 0
    while scorer.searching(tries):
        tries += 1
        guided = proposer is not None and (policy_fraction >= 1.0 or rng.random() < policy_fraction)
        cand, move = proposer.propose(cur, rng, seen) if guided else (None, None)
        if cand is None and (not guided or policy_fraction < 1.0):  # also when the policy had nothing new
            guided, cand = False, _propose(space, cur, rng)
        if cand is None:
            continue
        counts["policy" if guided else "mcmc"] += 1
        out = scorer(cand)
        cand_digest = digest(cand) if proposer is not None else None  # once: seen, and the proposer's memory
        if cand_digest is not None:
            seen.add(cand_digest)
        if out is None:
            continue
        e = energy(out)
        if anneal.accept(e, cur_e, scorer.evaluations, rng):
            cur, cur_e = cand, e
            counts["accepted"] += 1
            if proposer is not None and move is not None:
                proposer.accepted(move, cand_digest)
            elif proposer is not None:
                proposer.sync(cur, cand_digest)
        if out.key() < best_out.key():
            best, best_out = cand, out
            anneal.new_best(scorer.evaluations)
            curve.append((scorer.evaluations, best_out.value))
    counts["setup"] = proposer.coarse_evaluations if proposer is not None else 0
    counts["reheats"] = anneal.reheats
    return _result(best, best_out, scorer, seed, curve, counts, note, time.perf_counter() - began)


def digest(plan: Plan) -> bytes:
    """A short fingerprint of a plan's decisions (its ``key()``)."""
    return hashlib.blake2b(plan.key(), digest_size=16).digest()


def _budget(seconds: float | None, evaluations: int | None, policy_fraction: float,
            groups_per_round: int) -> Budget:
    if seconds is None and evaluations is None:
        raise GuidedSearchError("guided search needs a time budget (seconds) or an evaluation budget")
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise GuidedSearchError(f"guided search seconds must be a finite number > 0, got {seconds}")
    if evaluations is not None and (isinstance(evaluations, bool) or int(evaluations) < 1):
        raise GuidedSearchError(f"guided search evaluations must be an integer >= 1, got {evaluations}")
    if not 0.0 <= policy_fraction <= 1.0:
        raise GuidedSearchError(f"policy_fraction must be in [0, 1], got {policy_fraction}")
    if groups_per_round < 1:
        raise GuidedSearchError(f"groups_per_round must be >= 1, got {groups_per_round}")
    return Budget(seconds=None if seconds is None else float(seconds),
                  evaluations=None if evaluations is None else int(evaluations))


def _proposer(model, graph: OpGraph, topology: Topology, objective: str, max_groups: int | None,
              groups_per_round: int, policy_fraction: float, uniform: bool = False,
              global_batch: int | None = None) -> tuple[PolicyProposer | None, str]:
    """The policy's proposer, or None and why not."""
    if model is None or policy_fraction <= 0.0:
        return None, "" if policy_fraction <= 0.0 else "no policy: plain MCMC"
    try:
        proposer = PolicyProposer(model, graph, topology, objective, max_groups, groups_per_round, uniform,
                                  global_batch)
    except RlplaceError as exc:  # the task does not fit the policy's environment: plain MCMC moves
        return None, f"policy not used ({exc}); plain MCMC moves"
    return proposer, ""


def _result(best: Plan, best_out: Outcome, scorer: Scorer, seed: int, curve: list[tuple[int, float]],
            counts: dict[str, int], note: str, seconds: float) -> GuidedResult:
    plan = finish(best, "guided_search", seed, scorer, accepted=counts["accepted"],
                  policy_proposals=counts["policy"], mcmc_proposals=counts["mcmc"], reheats=counts["reheats"],
                  saturated=scorer.saturated())
    if curve[-1][0] != scorer.evaluations:
        curve.append((scorer.evaluations, best_out.value))
    return GuidedResult(plan=plan, value=best_out.value, oom=best_out.oom, evaluation=best_out.evaluation,
                        evaluations=scorer.evaluations, setup_evaluations=counts["setup"], curve=curve, seconds=seconds,
                        policy_proposals=counts["policy"], mcmc_proposals=counts["mcmc"],
                        accepted=counts["accepted"], note=note, saturated=scorer.saturated())


__all__ = ["guided_search", "GuidedResult", "GuidedSearchError", "PolicyProposer", "POLICY_FRACTION",
           "GROUPS_PER_ROUND"]
