"""The placement policy: a graph neural network over the padded Dict observation of ``PlacementEnv``.

Pieces (all plain torch, batched over the padded arrays, masks respected everywhere):

- **Device encoder** — an MLP over each device's static features and dynamic state, then rounds of
  mixing in which every device averages the others weighted by the pairwise (log) bandwidth matrix,
  so that devices sharing a fast link get similar embeddings.
- **Graph encoder** — node features + node state + "being decided" flag, plus the mean embedding of
  the devices each node already sits on (``node_devices`` x device embeddings); then ``rounds`` of
  message passing along *and* against the edges: messages ``MLP([h_src, edge features]) * w_e`` with
  ``w_e`` a learned gate of the edge's bytes, gathered by ``edge_index`` and scatter-added with
  ``index_add_``, normalised by the (masked) degree, and a residual update with LayerNorm.
- **Option scorer** — for each option: ``MLP([option features, option state, mean embedding of its
  devices, embedding of the node being decided, graph summary]) -> logit``. The same weights serve
  any number of nodes, devices and options up to the padding.
- **Global heads** — the first three decisions of an episode (microbatches, schedule, recompute) are
  scored by small heads on the graph summary; the ``phase`` one-hot picks which logits apply.
- **Value head** — an MLP over the pooled embedding (masked mean of nodes and of devices, globals).

:class:`GraphPlacementPolicy` plugs this into sb3-contrib's ``MaskableActorCriticPolicy``: the features
extractor emits ``[per-action logits | pooled embedding]``, :class:`SplitLatent` routes the logits to
the actor unchanged (the action net is the identity) and the pooled part to the value MLP;
MaskablePPO's mask sets the logits of unavailable actions to ``-1e8``.
"""

from __future__ import annotations

import gymnasium as gym
import torch as th
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

N_GLOBAL_HEADS = 3  # microbatches, schedule, recompute


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
    ``option_features`` rows), which :mod:`agent.infer` uses to run a policy on larger graphs and
    topologies than it was trained with."""

    def __init__(self, observation_space: gym.spaces.Dict, hidden: int = 64, rounds: int = 3,
                 device_rounds: int = 2, prior: tuple[float, ...] | None = None):
        sp = observation_space.spaces
        self.max_options = int(sp["option_features"].shape[0])
        self.n_globals = int(sp["globals"].shape[0])
        self.n_phases = int(sp["phase"].shape[0])
        self.hidden = int(hidden)
        super().__init__(observation_space, features_dim=self.max_options + self.pooled_dim)
        node_in = sp["node_features"].shape[1] + sp["node_state"].shape[1] + 1
        dev_in = sp["device_features"].shape[1] + sp["device_state"].shape[1] + 3
        opt_in = sp["option_features"].shape[1] + sp["option_state"].shape[1]
        edge_dim = sp["edge_features"].shape[1]
        h = self.hidden
        self.dev_in = mlp([dev_in, h, h], last_act=True)
        self.dev_mix = nn.ModuleList([mlp([2 * h, h, h]) for _ in range(device_rounds)])
        self.dev_norm = nn.ModuleList([nn.LayerNorm(h) for _ in range(device_rounds)])
        self.node_in = mlp([node_in, h, h], last_act=True)
        self.node_dev = nn.Linear(h, h)
        self.rounds = nn.ModuleList([MessagePassing(h, edge_dim) for _ in range(rounds)])
        self.opt_in = mlp([opt_in, h], last_act=True)
        ctx = self.n_globals + self.n_phases
        self.scorer = mlp([4 * h + ctx, h, h, 1])
        self.global_heads = mlp([2 * h + ctx, h, N_GLOBAL_HEADS * self.max_options])
        # optional learnable prior on the option-state columns (memory after, log2 time ratio, input
        # locality): logit += prior . option_state. It starts the policy near "fast options where the
        # inputs already are" instead of uniform, which the sparse end-of-episode reward needs.
        self.option_prior = None if prior is None else nn.Parameter(th.tensor([float(x) for x in prior]))
        for head in (self.scorer[-1], self.global_heads[-1]):  # start near the uniform policy
            nn.init.normal_(head.weight, std=1e-3)
            nn.init.zeros_(head.bias)

    @property
    def pooled_dim(self) -> int:
        return 2 * self.hidden + self.n_globals + self.n_phases

    # ------------------------------------------------------------------ encoders
    def encode_devices(self, obs: dict[str, th.Tensor]) -> th.Tensor:
        dmask = obs["device_mask"]
        bw = obs["device_bandwidth"] * dmask.unsqueeze(1) * dmask.unsqueeze(2)
        cnt = dmask.sum(1, keepdim=True).clamp(min=1.0)
        bw_stats = th.stack([bw.sum(2) / cnt, bw.max(2).values,
                             (obs["device_latency"] * dmask.unsqueeze(1)).sum(2) / cnt], dim=-1)
        d = self.dev_in(th.cat([obs["device_features"], obs["device_state"], bw_stats], dim=-1))
        w = bw / bw.sum(2, keepdim=True).clamp(min=1e-6)  # bandwidth-weighted neighbourhood
        for mix, norm in zip(self.dev_mix, self.dev_norm):
            d = norm(d + mix(th.cat([d, th.bmm(w, d)], dim=-1)))
            d = d * dmask.unsqueeze(-1)
        return d

    def encode_nodes(self, obs: dict[str, th.Tensor], dev: th.Tensor) -> th.Tensor:
        b, n = obs["node_mask"].shape
        nmask = obs["node_mask"]
        x = th.cat([obs["node_features"], obs["node_state"], obs["current_node"].unsqueeze(-1)], dim=-1)
        nd = obs["node_devices"]
        on_dev = th.bmm(nd, dev) / nd.sum(2, keepdim=True).clamp(min=1e-6)
        h = (self.node_in(x) + self.node_dev(on_dev)) * nmask.unsqueeze(-1)
        ei = obs["edge_index"].long().clamp(0, n - 1)
        offset = (th.arange(b, device=ei.device) * n).view(b, 1)
        src = (ei[:, 0] + offset).reshape(-1)
        dst = (ei[:, 1] + offset).reshape(-1)
        ef = obs["edge_features"].reshape(-1, obs["edge_features"].shape[-1])
        em = obs["edge_mask"].reshape(-1)
        flat_mask = nmask.reshape(-1)
        h = h.reshape(b * n, -1)
        for layer in self.rounds:
            h = layer(h, src, dst, ef, em, flat_mask)
        return h.reshape(b, n, -1)

    # ------------------------------------------------------------------ heads
    def action_logits_and_pooled(self, obs: dict[str, th.Tensor]) -> tuple[th.Tensor, th.Tensor]:
        """(logits [B, options], pooled [B, pooled_dim]) for any padding of the observation."""
        dev = self.encode_devices(obs)
        nodes = self.encode_nodes(obs, dev)
        g_nodes = masked_mean(nodes, obs["node_mask"])
        g_dev = masked_mean(dev, obs["device_mask"])
        ctx = th.cat([obs["globals"], obs["phase"]], dim=-1)
        pooled = th.cat([g_nodes, g_dev, ctx], dim=-1)
        k = obs["option_features"].shape[1]
        cur = (nodes * obs["current_node"].unsqueeze(-1)).sum(1)
        od = obs["option_devices"]
        opt_dev = th.bmm(od, dev) / od.sum(2, keepdim=True).clamp(min=1.0)
        opt = self.opt_in(th.cat([obs["option_features"], obs["option_state"]], dim=-1))
        rows = th.cat([opt, opt_dev, cur.unsqueeze(1).expand(-1, k, -1), g_nodes.unsqueeze(1).expand(-1, k, -1),
                       ctx.unsqueeze(1).expand(-1, k, -1)], dim=-1)
        place_logits = self.scorer(rows).squeeze(-1)
        if self.option_prior is not None:
            place_logits = place_logits + obs["option_state"] @ self.option_prior
        glob = self.global_heads(th.cat([g_nodes, g_dev, ctx], dim=-1)).view(-1, N_GLOBAL_HEADS, self.max_options)
        if k >= self.max_options:
            glob = nn.functional.pad(glob, (0, k - self.max_options))
        else:
            glob = glob[..., :k]
        phase = obs["phase"]
        logits = phase[:, N_GLOBAL_HEADS:].sum(-1, keepdim=True) * place_logits
        logits = logits + (phase[:, :N_GLOBAL_HEADS].unsqueeze(-1) * glob).sum(1)
        return logits, pooled

    def forward(self, observations: dict[str, th.Tensor]) -> th.Tensor:
        logits, pooled = self.action_logits_and_pooled(observations)
        return th.cat([logits, pooled], dim=-1)


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

    ``policy_kwargs``: ``hidden`` (embedding width), ``rounds`` (message-passing rounds),
    ``device_rounds``, ``value_hidden`` and ``prior`` (initial weights of the option-state prior, or
    None for none); the rest as ``MaskableActorCriticPolicy``."""

    def __init__(self, observation_space: gym.spaces.Dict, action_space: gym.spaces.Discrete, lr_schedule,
                 hidden: int = 64, rounds: int = 3, device_rounds: int = 2, value_hidden: int = 64,
                 prior: tuple[float, ...] | None = None, **kwargs):
        self.value_hidden = int(value_hidden)
        kwargs.setdefault("ortho_init", False)  # the extractor initialises its output heads itself
        kwargs["features_extractor_class"] = GraphPlacementExtractor
        kwargs["features_extractor_kwargs"] = {"hidden": int(hidden), "rounds": int(rounds),
                                               "device_rounds": int(device_rounds),
                                               "prior": None if prior is None else tuple(prior)}
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
                    prior=fk.get("prior"))
        return data


__all__ = ["GraphPlacementPolicy", "GraphPlacementExtractor", "SplitLatent", "MessagePassing"]
