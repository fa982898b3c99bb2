"""The placement policy: a graph neural network over the padded Dict observation of ``PlacementEnv``.

The network is split like the observation (circuit_training's static / dynamic split): the expensive
part sees only the **static** arrays of a task and is computed once per distinct task, the cheap part
adds the **dynamic** state of the episode at every step.

Static part (per task; deduplicated inside a batch and cached between steps at inference):

- **Device encoder** — an MLP over each device's static features and link statistics, then rounds of
  mixing in which every device averages the others weighted by the pairwise (log) bandwidth matrix,
  so that devices sharing a fast link get similar embeddings.
- **Graph encoder** — node features, then ``rounds`` of message passing along *and* against the
  edges: messages ``MLP([h_src, edge features]) * w_e`` with ``w_e`` a learned gate of the edge's
  bytes, gathered by ``edge_index`` and scatter-added with ``index_add_``, normalised by the (masked)
  degree, and a residual update with LayerNorm.

Dynamic part (every step): device embedding + MLP(device state); node embedding + MLP(node state,
"being decided" flag) + the mean embedding of the devices the node already sits on
(``node_devices`` x device embeddings), then ``dynamic_rounds`` (default 1) more message-passing
rounds so a node sees where its neighbours were placed. Measured: without that round a short PPO run
on tiny graphs got worse instead of better; with it, a PPO update on a 200-group graph is about 4x
slower (22 s vs 5 s per 1024 steps on this 2-core machine).

- **Action scorer** — an action is a placement row x a modifier row (``envs.placement.options``). For
  each placement: ``z = MLP([placement features, placement state, mean embedding of its devices,
  embedding of the node being decided, graph summary])`` and a logit from ``z``; for each (placement,
  modifier): a small MLP over ``[W z, modifier features, action state]`` adds the modifier's logit
  (a factored score: placements x modifiers rows cost one small layer each). The same weights serve
  any number of nodes, devices and placements up to the padding, and new modifier rows.
- **Global heads** — the global decisions of an episode (microbatches, schedule, virtual stages) are
  scored by small heads on the graph summary (``GLOBAL_CHOICES`` logits each, the first actions); the
  ``phase`` one-hot picks which logits apply.
- **Value head** — an MLP over the pooled embedding (masked mean of nodes and of devices, globals).

Which arrays are static and which dynamic is the environment's declaration
(:data:`envs.placement.observation.STATIC_KEYS` / ``DYNAMIC_KEYS``): the static encoders read only
static keys (the graph and device ones), the dynamic part the rest. Distinct tasks are told apart by
an exact integer fingerprint of all their static arrays. In a PPO minibatch the static encoders run
once per distinct task and their output is gathered back to the rows (gradients flow through the
gather, so this is exact). Without gradients (rollout collection, :mod:`agent.infer`) the static
embeddings are also kept in a small LRU cache, stamped with the parameters' version counters so any
optimiser step or ``load_state_dict`` discards them.

:class:`GraphPlacementPolicy` plugs this into sb3-contrib's ``MaskableActorCriticPolicy``: the features
extractor emits ``[per-action logits | pooled embedding]``, :class:`SplitLatent` routes the logits to
the actor unchanged (the action net is the identity) and the pooled part to the value MLP;
MaskablePPO's mask sets the logits of unavailable actions to ``-1e8``.
"""

from __future__ import annotations

from collections import OrderedDict

import gymnasium as gym
import torch as th
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from envs.placement.observation import GLOBAL_CHOICES, GLOBAL_PHASES, PLACE_PHASE, STATIC_KEYS

N_GLOBAL_HEADS = len(GLOBAL_PHASES)  # microbatches, schedule, virtual stages
MODIFIER_HIDDEN = 16  # width of the per-(placement, modifier) layer
MODIFIER_PRIOR = (0.0, -4.0, -4.0, -2.0)
# output layers start small (a near-uniform policy, plus the priors) but not so small that cloning a
# plan needs thousands of steps to grow them: with 1e-3, 200 Adam steps cloned 8 decisions to 75%
HEAD_INIT_STD = 0.05  # initial weights on the action-state columns (see the extractor)


def mlp(sizes: list[int], act: type[nn.Module] = nn.SiLU, last_act: bool = False) -> nn.Sequential:
    """A plain MLP ``sizes[0] -> ... -> sizes[-1]``."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_act:
            layers.append(act())
    return nn.Sequential(*layers)


def masked_mean(x: th.Tensor, mask: th.Tensor) -> th.Tensor:
    """Mean of ``x`` [B, N, H] over the rows where ``mask`` [B, N] is 1."""
    return (x * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1.0)


class MessagePassing(nn.Module):
    """One round along and against the edges (gather by ``edge_index``, scatter-add, degree-normalised)."""

    def __init__(self, hidden: int, edge_dim: int):
        super().__init__()
        self.msg_fwd = mlp([hidden + edge_dim, hidden, hidden])
        self.msg_bwd = mlp([hidden + edge_dim, hidden, hidden])
        self.gate_fwd = nn.Linear(edge_dim, 1)
        self.gate_bwd = nn.Linear(edge_dim, 1)
        self.update = mlp([3 * hidden, hidden, hidden])
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: th.Tensor, src: th.Tensor, dst: th.Tensor, ef: th.Tensor, em: th.Tensor,
                node_mask: th.Tensor) -> th.Tensor:
        """``h`` [B*N, H] flat node states; ``src``/``dst`` [E] flat indices; ``ef`` [E, F]; ``em`` [E]."""
        agg = []
        for msg, gate, a, b in ((self.msg_fwd, self.gate_fwd, src, dst), (self.msg_bwd, self.gate_bwd, dst, src)):
            w = th.sigmoid(gate(ef)).squeeze(-1) * em  # edge weight from its bytes; padding -> 0
            m = msg(th.cat([h[a], ef], dim=-1)) * w.unsqueeze(-1)
            out = th.zeros_like(h).index_add_(0, b, m)
            deg = th.zeros(h.shape[0], dtype=h.dtype, device=h.device).index_add_(0, b, em)
            agg.append(out / deg.clamp(min=1.0).unsqueeze(-1))
        h = self.norm(h + self.update(th.cat([h, *agg], dim=-1)))
        return h * node_mask.unsqueeze(-1)


class GraphPlacementExtractor(BaseFeaturesExtractor):
    """GNN over the placement observation; ``forward`` returns ``[action logits | pooled embedding]``.

    :meth:`action_logits_and_pooled` works for any padding (the number of actions is the observation's
    ``option_features`` rows x the modifier rows), which :mod:`agent.infer` uses to run a policy on larger graphs and
    topologies than it was trained with."""

    def __init__(self, observation_space: gym.spaces.Dict, hidden: int = 64, rounds: int = 3,
                 device_rounds: int = 2, prior: tuple[float, ...] | None = None, dynamic_rounds: int = 1,
                 cache_size: int = 32):
        sp = observation_space.spaces
        self.max_options = int(sp["option_features"].shape[0])
        self.n_modifiers = int(sp["modifier_features"].shape[0])
        self.n_actions = int(sp["action_mask"].shape[0])
        self.n_globals = int(sp["globals"].shape[0])
        self.n_phases = int(sp["phase"].shape[0])
        self.hidden = int(hidden)
        super().__init__(observation_space, features_dim=self.n_actions + self.pooled_dim)
        opt_in = sp["option_features"].shape[1] + sp["option_state"].shape[1]
        edge_dim = sp["edge_features"].shape[1]
        h = self.hidden
        # static encoders
        self.dev_in = mlp([sp["device_features"].shape[1] + 3, h, h], last_act=True)
        self.dev_mix = nn.ModuleList([mlp([2 * h, h, h]) for _ in range(device_rounds)])
        self.dev_norm = nn.ModuleList([nn.LayerNorm(h) for _ in range(device_rounds)])
        self.node_in = mlp([sp["node_features"].shape[1], h, h], last_act=True)
        self.rounds = nn.ModuleList([MessagePassing(h, edge_dim) for _ in range(rounds)])
        # dynamic part
        self.dev_state = mlp([sp["device_state"].shape[1], h, h])
        self.node_state = mlp([sp["node_state"].shape[1] + 1, h, h])
        self.node_dev = nn.Linear(h, h)
        self.dyn_norm = nn.LayerNorm(h)
        self.dyn_rounds = nn.ModuleList([MessagePassing(h, edge_dim) for _ in range(int(dynamic_rounds))])
        self.opt_in = mlp([opt_in, h], last_act=True)
        ctx = self.n_globals + self.n_phases
        self.scorer = mlp([4 * h + ctx, h, h], last_act=True)
        self.score_out = nn.Linear(h, 1)
        mh = MODIFIER_HIDDEN
        self.mod_proj = nn.Linear(h, mh)
        self.mod_in = nn.Linear(sp["modifier_features"].shape[1] + sp["action_state"].shape[-1], mh)
        self.mod_out = nn.Sequential(nn.SiLU(), nn.Linear(mh, 1))
        self.global_heads = mlp([2 * h + ctx, h, N_GLOBAL_HEADS * GLOBAL_CHOICES])
        # optional learnable prior on the option-state columns (memory after, log2 time ratio, input
        # locality): logit += prior . option_state. It starts the policy near "fast options where the
        # inputs already are" instead of uniform, which the sparse end-of-episode reward needs.
        self.option_prior = None if prior is None else nn.Parameter(th.tensor([float(x) for x in prior]))
        # the same for the action-state columns (memory after, overflow, log2 compute factor, log2 gradient
        # sync factor): a modifier that overflows memory or adds compute or communication starts unlikely
        self.modifier_prior = nn.Parameter(th.tensor(MODIFIER_PRIOR))
        for head in (self.score_out, self.mod_out[-1], self.global_heads[-1]):  # start near the uniform policy
            nn.init.normal_(head.weight, std=HEAD_INIT_STD)
            nn.init.zeros_(head.bias)
        self._cache: OrderedDict[tuple, tuple[th.Tensor, th.Tensor]] = OrderedDict()
        self._cache_size = int(cache_size)
        self._cache_stamp: tuple | None = None
        self._proj: dict[tuple, th.Tensor] = {}
        self._params: list[nn.Parameter] | None = None

    @property
    def pooled_dim(self) -> int:
        return 2 * self.hidden + self.n_globals + self.n_phases

    # ------------------------------------------------------------------ static encoders (per task)
    def encode_devices(self, obs: dict[str, th.Tensor]) -> th.Tensor:
        dmask = obs["device_mask"]
        bw = obs["device_bandwidth"] * dmask.unsqueeze(1) * dmask.unsqueeze(2)
        cnt = dmask.sum(1, keepdim=True).clamp(min=1.0)
        bw_stats = th.stack([bw.sum(2) / cnt, bw.max(2).values,
                             (obs["device_latency"] * dmask.unsqueeze(1)).sum(2) / cnt], dim=-1)
        d = self.dev_in(th.cat([obs["device_features"], bw_stats], dim=-1))
        w = bw / bw.sum(2, keepdim=True).clamp(min=1e-6)  # bandwidth-weighted neighbourhood
        for mix, norm in zip(self.dev_mix, self.dev_norm):
            d = norm(d + mix(th.cat([d, th.bmm(w, d)], dim=-1)))
            d = d * dmask.unsqueeze(-1)
        return d

    @staticmethod
    def _edges(obs: dict[str, th.Tensor]) -> tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor, th.Tensor]:
        """Flat (src, dst, edge features, edge mask, node mask) over the batch's node slots."""
        b, n = obs["node_mask"].shape
        ei = obs["edge_index"].long().clamp(0, n - 1)
        offset = (th.arange(b, device=ei.device) * n).view(b, 1)
        src = (ei[:, 0] + offset).reshape(-1)
        dst = (ei[:, 1] + offset).reshape(-1)
        ef = obs["edge_features"].reshape(-1, obs["edge_features"].shape[-1])
        return src, dst, ef, obs["edge_mask"].reshape(-1), obs["node_mask"].reshape(-1)

    def encode_nodes(self, obs: dict[str, th.Tensor]) -> th.Tensor:
        b, n = obs["node_mask"].shape
        src, dst, ef, em, flat_mask = self._edges(obs)
        h = (self.node_in(obs["node_features"]) * obs["node_mask"].unsqueeze(-1)).reshape(b * n, -1)
        for layer in self.rounds:
            h = layer(h, src, dst, ef, em, flat_mask)
        return h.reshape(b, n, -1)

    def _fingerprint(self, obs: dict[str, th.Tensor]) -> tuple[th.Tensor, int]:
        """[B, 2] int64 fingerprints of the rows' static arrays (every STATIC_KEYS array), and the
        flattened length.

        The float32 bit patterns times fixed random integers, summed with int64 wrap-around: exact
        integer arithmetic, so identical rows always get identical fingerprints."""
        b = obs["node_mask"].shape[0]
        flat = th.cat([obs[k].reshape(b, -1).float() for k in STATIC_KEYS], dim=1).contiguous()
        bits = flat.view(th.int32).long()
        key = (bits.shape[1], bits.device)
        weights = self._proj.get(key)
        if weights is None:  # fixed (not parameters): the same in every process and run
            gen = th.Generator().manual_seed(bits.shape[1])
            weights = th.randint(1, 2**31 - 1, (2, bits.shape[1]), generator=gen, dtype=th.int64).to(bits.device)
            self._proj[key] = weights
        fp = th.stack([(bits * weights[0]).sum(1), (bits * weights[1]).sum(1)], dim=1)
        return fp, int(bits.shape[1])

    def _stamp(self) -> tuple:
        """Changes whenever a parameter is written in place (optimiser step, load_state_dict) or moved."""
        if self._params is None:
            self._params = list(self.parameters())
        return tuple((p.data_ptr(), p._version) for p in self._params)

    def static_embeddings(self, obs: dict[str, th.Tensor]) -> tuple[th.Tensor, th.Tensor]:
        """(devices [B, D, H], nodes [B, N, H]) from the static arrays, once per distinct task."""
        fp, length = self._fingerprint(obs)
        uniq, first, inverse = _unique_rows(fp)
        grad = th.is_grad_enabled()
        found: dict[int, tuple[th.Tensor, th.Tensor]] = {}  # unique row -> its embeddings
        keys: list[tuple] = []
        if not grad:
            stamp = self._stamp()
            if stamp != self._cache_stamp:
                self._cache.clear()
                self._cache_stamp = stamp
            keys = [(length, *uniq[i].tolist()) for i in range(uniq.shape[0])]
            for i, k in enumerate(keys):  # the hits first: inserting the misses below may evict them
                if k in self._cache:
                    self._cache.move_to_end(k)
                    found[i] = self._cache[k]
        missing = [i for i in range(uniq.shape[0]) if i not in found]
        if missing:
            rows = first[missing]
            sub = {k: obs[k][rows] for k in STATIC_KEYS}
            dev, nodes = self.encode_devices(sub), self.encode_nodes(sub)
            for j, i in enumerate(missing):
                found[i] = (dev[j], nodes[j])
                if not grad:
                    self._cache[keys[i]] = found[i]
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)
        dev_u = th.stack([found[i][0] for i in range(uniq.shape[0])])
        node_u = th.stack([found[i][1] for i in range(uniq.shape[0])])
        return dev_u[inverse], node_u[inverse]

    # ------------------------------------------------------------------ dynamic part (per step)
    def dynamic_embeddings(self, obs: dict[str, th.Tensor], dev_s: th.Tensor,
                           node_s: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        dmask, nmask = obs["device_mask"].unsqueeze(-1), obs["node_mask"]
        dev = (dev_s + self.dev_state(obs["device_state"])) * dmask
        nd = obs["node_devices"]
        # node_dev(mean of the node's device embeddings), with the linear map applied to the few devices
        # before the averaging (the same affine function, without a [B, N, h] x [h, h] product)
        dev_w = nn.functional.linear(dev, self.node_dev.weight)
        on_dev = th.bmm(nd, dev_w) / nd.sum(2, keepdim=True).clamp(min=1e-6) + self.node_dev.bias
        state = th.cat([obs["node_state"], obs["current_node"].unsqueeze(-1)], dim=-1)
        nodes = self.dyn_norm(node_s + _rowwise(self.node_state, state) + on_dev) * nmask.unsqueeze(-1)
        if len(self.dyn_rounds):
            b, n = nmask.shape
            src, dst, ef, em, flat_mask = self._edges(obs)
            h = nodes.reshape(b * n, -1)
            for layer in self.dyn_rounds:
                h = layer(h, src, dst, ef, em, flat_mask)
            nodes = h.reshape(b, n, -1)
        return dev, nodes

    # ------------------------------------------------------------------ heads
    def action_logits_and_pooled(self, obs: dict[str, th.Tensor]) -> tuple[th.Tensor, th.Tensor]:
        """(logits [B, options], pooled [B, pooled_dim]) for any padding of the observation."""
        return self.logits_from_embeddings(obs, *self.static_embeddings(obs))

    def logits_from_embeddings(self, obs: dict[str, th.Tensor], dev_s: th.Tensor,
                               node_s: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """As :meth:`action_logits_and_pooled`, given the static embeddings of the rows' tasks.

        The ``phase`` one-hot picks each row's logits: the action scorer's in the place phase, a global
        head's otherwise. A head no row of the batch is in is not computed (its logits would be
        multiplied by zero; no gradient reaches it either), so a rollout step runs one of them."""
        dev, nodes = self.dynamic_embeddings(obs, dev_s, node_s)
        g_nodes = masked_mean(nodes, obs["node_mask"])
        g_dev = masked_mean(dev, obs["device_mask"])
        phase = obs["phase"]
        ctx = th.cat([obs["globals"], phase], dim=-1)
        pooled = th.cat([g_nodes, g_dev, ctx], dim=-1)
        n_act = obs["option_features"].shape[1] * self.n_modifiers
        logits = th.zeros(phase.shape[0], n_act, dtype=nodes.dtype, device=nodes.device)
        rows_in = phase.detach().sum(0).tolist()  # rows of the batch in each phase
        if rows_in[PLACE_PHASE] > 0:
            action_logits = self._action_logits(obs, dev, nodes, g_nodes, ctx)
            logits = logits + phase[:, PLACE_PHASE:PLACE_PHASE + 1] * action_logits
        if any(rows_in[i] > 0 for i in GLOBAL_PHASES):
            glob = self.global_heads(pooled).view(-1, N_GLOBAL_HEADS, GLOBAL_CHOICES)
            glob = (nn.functional.pad(glob, (0, n_act - GLOBAL_CHOICES)) if n_act >= GLOBAL_CHOICES
                    else glob[..., :n_act])
            logits = logits + (phase[:, list(GLOBAL_PHASES)].unsqueeze(-1) * glob).sum(1)
        return logits, pooled

    def _action_logits(self, obs: dict[str, th.Tensor], dev: th.Tensor, nodes: th.Tensor, g_nodes: th.Tensor,
                       ctx: th.Tensor) -> th.Tensor:
        """[B, options x modifiers]: a placement's score plus its modifier's score (the place phase)."""
        k = obs["option_features"].shape[1]
        cur = (nodes * obs["current_node"].unsqueeze(-1)).sum(1)
        od = obs["option_devices"]
        opt_dev = th.bmm(od, dev) / od.sum(2, keepdim=True).clamp(min=1.0)
        opt = self.opt_in(th.cat([obs["option_features"], obs["option_state"]], dim=-1))
        rows = th.cat([opt, opt_dev, cur.unsqueeze(1).expand(-1, k, -1), g_nodes.unsqueeze(1).expand(-1, k, -1),
                       ctx.unsqueeze(1).expand(-1, k, -1)], dim=-1)
        z = self.scorer(rows)
        place_logits = self.score_out(z).squeeze(-1)
        if self.option_prior is not None:
            place_logits = place_logits + obs["option_state"] @ self.option_prior
        b, km = z.shape[0], self.n_modifiers
        mods = obs["modifier_features"].unsqueeze(1).expand(-1, k, -1, -1)
        pair = self.mod_in(th.cat([mods, obs["action_state"]], dim=-1)) + self.mod_proj(z).unsqueeze(2)
        mod_logits = self.mod_out(pair).squeeze(-1) + obs["action_state"] @ self.modifier_prior
        return (place_logits.unsqueeze(-1) + mod_logits).reshape(b, k * km)

    def forward(self, observations: dict[str, th.Tensor]) -> th.Tensor:
        logits, pooled = self.action_logits_and_pooled(observations)
        return th.cat([logits, pooled], dim=-1)


# below this many rows ``f`` on every row is faster than finding the distinct ones (one thread, the
# shipped policy's node-state MLP: 500 rows 0.16 ms direct vs 0.81 ms deduplicated; 8,000 rows equal
# without gradients; 32,000 rows 8.7 vs 6.1 ms, and 29 vs 9.5 ms with the backward pass)
ROWWISE_MIN_ROWS = 4096


def _rowwise(f: nn.Module, x: th.Tensor) -> th.Tensor:
    """``f(x)`` for a row-wise ``f`` over [..., d] inputs, evaluated once per distinct row when there are
    many rows (a PPO minibatch): node states take few distinct values (unassigned, or one per option), so
    this skips most of the rows."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] < ROWWISE_MIN_ROWS:
        return f(x)
    # rows are grouped by a float64 random projection (th.unique over rows sorts them: ~50x slower),
    # then checked against their group's representative, so a collision falls back to every row
    proj = th.linspace(1.0, 2.0, flat.shape[-1], dtype=th.float64, device=x.device) ** 0.5 + 0.1234567
    keys, inverse = th.unique(flat.detach().double() @ proj, return_inverse=True)
    if keys.shape[0] * 2 > flat.shape[0]:
        return f(x)
    rep = th.empty(keys.shape[0], dtype=th.long, device=x.device).scatter_(
        0, inverse, th.arange(flat.shape[0], device=x.device))
    uniq = flat[rep]
    if not th.equal(uniq[inverse], flat):
        return f(x)
    return f(uniq)[inverse].reshape(*x.shape[:-1], -1)


def _unique_rows(fp: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor]:
    """(unique rows, index of each unique row's first occurrence, inverse map) of ``fp`` [B, 2] int64."""
    uniq, inverse = th.unique(fp, dim=0, return_inverse=True)
    first = th.full((uniq.shape[0],), fp.shape[0], dtype=th.long, device=fp.device)
    first.scatter_reduce_(0, inverse, th.arange(fp.shape[0], device=fp.device), reduce="amin")
    return uniq, first, inverse


class SplitLatent(nn.Module):
    """The ``mlp_extractor``: the logits go to the actor as they are, the pooled part through a value MLP."""

    def __init__(self, n_actions: int, pooled_dim: int, value_hidden: int = 64):
        super().__init__()
        self.n_actions = n_actions
        self.latent_dim_pi = n_actions
        self.latent_dim_vf = value_hidden
        self.value_mlp = mlp([pooled_dim, value_hidden, value_hidden], last_act=True)

    def forward(self, features: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        return self.forward_actor(features), self.forward_critic(features)

    def forward_actor(self, features: th.Tensor) -> th.Tensor:
        return features[:, :self.n_actions]

    def forward_critic(self, features: th.Tensor) -> th.Tensor:
        return self.value_mlp(features[:, self.n_actions:])


class GraphPlacementPolicy(MaskableActorCriticPolicy):
    """MaskablePPO actor-critic whose action logits are the GNN's per-option scores.

    ``policy_kwargs``: ``hidden`` (embedding width), ``rounds`` (static message-passing rounds),
    ``dynamic_rounds`` (per-step rounds), ``device_rounds``, ``value_hidden`` and ``prior`` (initial weights of the option-state prior, or
    None for none); the rest as ``MaskableActorCriticPolicy``."""

    def __init__(self, observation_space: gym.spaces.Dict, action_space: gym.spaces.Discrete, lr_schedule,
                 hidden: int = 64, rounds: int = 3, device_rounds: int = 2, value_hidden: int = 64,
                 prior: tuple[float, ...] | None = None, dynamic_rounds: int = 1, **kwargs):
        self.value_hidden = int(value_hidden)
        kwargs.setdefault("ortho_init", False)  # the extractor initialises its output heads itself
        kwargs["features_extractor_class"] = GraphPlacementExtractor
        kwargs["features_extractor_kwargs"] = {"hidden": int(hidden), "rounds": int(rounds),
                                               "device_rounds": int(device_rounds),
                                               "prior": None if prior is None else tuple(prior),
                                               "dynamic_rounds": int(dynamic_rounds)}
        kwargs.pop("net_arch", None)
        super().__init__(observation_space, action_space, lr_schedule, **kwargs)

    def _build_mlp_extractor(self) -> None:
        fe: GraphPlacementExtractor = self.features_extractor  # type: ignore[assignment]
        self.mlp_extractor = SplitLatent(int(self.action_space.n), fe.pooled_dim, self.value_hidden)

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()  # the per-option scorer already produced the logits
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _get_constructor_parameters(self) -> dict:
        data = super()._get_constructor_parameters()
        fk = data.pop("features_extractor_kwargs", {}) or {}
        data.pop("features_extractor_class", None)
        data.pop("net_arch", None)
        data.update(hidden=fk.get("hidden", 64), rounds=fk.get("rounds", 3),
                    device_rounds=fk.get("device_rounds", 2), value_hidden=self.value_hidden,
                    prior=fk.get("prior"), dynamic_rounds=fk.get("dynamic_rounds", 1))
        return data


__all__ = ["GraphPlacementPolicy", "GraphPlacementExtractor", "SplitLatent", "MessagePassing"]
