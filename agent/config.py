"""The schema of a training config (``experiments/configs/NAME.yaml``; see :mod:`agent.train`).

Every section is a pydantic model that forbids unknown keys and coerces nothing (``strict``): an
integer field takes an integer, a number field a finite int or float, a flag ``true`` / ``false``.
(``envs.files`` reads ``3e-4`` in YAML as the number it means.) Ranges are the ones training needs to run
at all (``batch_size >= 2`` for the advantage normalisation, ``checkpoint_freq >= 1`` ...). The keys
of ``env`` are those :class:`envs.placement.env.PlacementEnv` takes, the keys of ``policy`` those
:class:`agent.policy.GraphPlacementPolicy` takes. :func:`agent.train.load_config` validates a file
with :func:`envs.files.validated`, so a problem is one line naming the file and the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from agent.imitation import BC_LEARNING_RATE
from agent.self_imitation import SETTINGS as SELF_IMITATION
from envs.coarsen import METHODS as COARSEN_METHODS
from envs.placement.env import MODES, REFINE_INITS
from envs.placement.observation import MICROBATCH_CHOICES, OPTION_STATE_FEATURES
from envs.placement.options import ORDERS
from envs.sim import OBJECTIVES
from profilers.spec import SAMPLE_SIZES as SPEC_SIZES

MAX_SEED = 2**31 - 1


Number = float  # finite (allow_inf_nan=False); an int is taken too
PositiveInt = Annotated[int, Field(ge=1)]
Count = Annotated[int, Field(ge=0)]


class Section(BaseModel):
    """A config section: unknown keys and loose types are errors, numbers must be finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class PPOSection(Section):
    """``ppo``: the MaskablePPO hyperparameters (unset ones take ``agent.train.DEFAULT_PPO``)."""

    learning_rate: Number = Field(3e-4, gt=0)
    n_steps: PositiveInt = 256
    batch_size: int = Field(128, ge=2)
    n_epochs: PositiveInt = 4
    gamma: Number = Field(1.0, ge=0, le=1)
    gae_lambda: Number = Field(0.95, ge=0, le=1)
    clip_range: Number = Field(0.2, gt=0)
    ent_coef: Number = Field(0.01, ge=0)
    vf_coef: Number = Field(0.5, ge=0)
    max_grad_norm: Number = Field(0.5, gt=0)


class EnvSection(Section):
    """``env``: the keyword arguments of :class:`envs.placement.env.PlacementEnv`."""

    max_nodes: PositiveInt = 32
    max_devices: PositiveInt = 8
    max_edges: PositiveInt | None = None
    max_options: Annotated[int, Field(ge=2)] | None = None
    mode: Literal[MODES] = "place"  # type: ignore[valid-type]
    objective: Literal[OBJECTIVES] = "step_time"  # type: ignore[valid-type]
    coarsen: bool = True
    coarsen_method: Literal[COARSEN_METHODS] = "auto"  # type: ignore[valid-type]
    order: Literal[ORDERS] = "topological"  # type: ignore[valid-type]
    microbatch_choices: list[PositiveInt] = Field(default_factory=lambda: list(MICROBATCH_CHOICES),
                                                  min_length=1, max_length=16)
    refine_passes: PositiveInt = 1
    refine_init: Literal[REFINE_INITS] = "best"  # type: ignore[valid-type]
    eval_graph: Literal["coarse", "fine"] = "fine"
    evaluate_steps: bool = True
    task_cache_size: PositiveInt = 64


class PolicySection(Section):
    """``policy``: the ``policy_kwargs`` of :class:`agent.policy.GraphPlacementPolicy`."""

    hidden: PositiveInt = 64
    rounds: Count = 3
    device_rounds: Count = 2
    dynamic_rounds: Count = 1
    value_hidden: PositiveInt = 64
    prior: list[Number] | None = None

    @field_validator("prior")
    @classmethod
    def _prior_length(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and len(v) != OPTION_STATE_FEATURES:
            raise ValueError(f"needs {OPTION_STATE_FEATURES} weights (one per option-state column)")
        return v


Range = Annotated[list[Number], Field(min_length=2, max_length=2)]
IntRange = Annotated[list[PositiveInt], Field(min_length=2, max_length=2)]


class DistributionSection(Section):
    """``tasks.distribution``: tasks drawn over model families at realistic sizes on random clusters
    (:func:`agent.distribution.draw_distribution`). A family is a name (``llama``, ``random-layered``) or a
    family spec mapping ``{model: my_model.py:build, knobs: {layers: [2, 12]}, name: mine}``, or a random-DAG
    generator under another name ``{generator: random-series-parallel, name: dags-heldout}``
    (:class:`profilers.families.FamilySpec`; checked here, before anything is traced)."""

    tasks: PositiveInt = 128
    holdout_tasks: Count = 24
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    families: list[str | dict] | None = None  # default: agent.distribution.TRAIN_FAMILIES
    holdout_families: list[str | dict] | None = None  # default: agent.distribution.HOLDOUT_FAMILIES
    devices: IntRange = Field(default_factory=lambda: [2, 16])
    hosts: IntRange = Field(default_factory=lambda: [1, 4])
    memory_scale: Range = Field(default_factory=lambda: [0.25, 1.0])

    @model_validator(mode="after")
    def _families_and_ranges(self) -> DistributionSection:
        from agent.distribution import DistributionError, families

        for name, (lo, hi) in (("devices", self.devices), ("hosts", self.hosts), ("memory_scale", self.memory_scale)):
            if lo > hi:
                raise ValueError(f"{name}: lo {lo} > hi {hi}")
        if not 0 < self.memory_scale[0] <= self.memory_scale[1] <= 4:
            raise ValueError("memory_scale must lie in (0, 4]")
        from agent.distribution import HOLDOUT_FAMILIES, TRAIN_FAMILIES

        names = []
        for entries, default in ((self.families, TRAIN_FAMILIES), (self.holdout_families, HOLDOUT_FAMILIES)):
            try:
                names.append({f.name for f in families(entries if entries is not None else default)})
            except DistributionError as exc:
                raise ValueError(str(exc)) from None
        if names[0] & names[1]:
            raise ValueError(f"families both trained on and held out: {', '.join(sorted(names[0] & names[1]))}")
        return self


class TasksSection(Section):
    """``tasks`` / ``eval_tasks``: graphs (built-in, specs, sampled families) x topologies x batches, or a
    drawn ``distribution`` (with ``expert_iteration``)."""

    builtin: list[str] | None = None
    families: list[str] | None = None
    n_specs: PositiveInt = 4
    size: Literal[SPEC_SIZES] = "small"  # type: ignore[valid-type]
    specs: list[str] | None = None
    topologies: list[str] | None = None
    batches: list[PositiveInt | None] | None = None
    distribution: DistributionSection | None = None

    @model_validator(mode="after")
    def _has_graphs(self) -> TasksSection:
        if not (self.builtin or self.specs or self.families or self.distribution):
            raise ValueError("needs 'builtin', 'specs', 'families' or 'distribution'")
        return self


class ExpertIterationSection(Section):
    """``expert_iteration``: rounds of search -> distillation -> PPO -> held-out evaluation
    (:mod:`agent.expert_iteration`; needs ``tasks.distribution``)."""

    rounds: PositiveInt = 3
    dataset: str | None = None  # default: RUN_DIR/dataset
    # The teacher must be far better than the student: measured on experiments/configs/target_c.yaml with the
    # twotower family, 300 / 150 / 150 left round 0's search flat on 12 of 16 tasks and the held-out members
    # at 0.979x the shipped policy; 3000 / 1000 / 1000 gave 1.089x in the same 30 minutes.
    search_evaluations: Count = 3000  # the dataset: MCMC from the best heuristic, per task
    target_evaluations: Count = 1000  # round 0: search in the environment's action space from the expressed best
    policy_evaluations: Count = 1000  # rounds > 0: the same search, from the best of the policy's plans too
    policy_samples: Count = 4  # sampled rollouts beside the greedy one when seeding the search
    # the target searches' annealing schedule (agent.guided_search: T0 in log step time, half-life in
    # evaluations); None: the guided search's own. A config pins it to keep reproducing what it trained
    target_t0: Annotated[Number, Field(gt=0)] | None = None
    target_half_life: Annotated[Number, Field(gt=0)] | None = None
    distill_epochs: PositiveInt = 8
    distill_batch_size: PositiveInt = 256
    distill_learning_rate: Number = Field(BC_LEARNING_RATE, gt=0)
    # DAgger: also clone the targets' labels on the states of the current policy's own greedy rollout
    # (measured on experiments/configs/target_c.yaml: held-out t5 0.999 -> 1.007 over the shipped policy)
    distill_on_policy_states: bool = True
    ppo_steps: Count = 16384  # per round
    eval_samples: Count = 8  # held-out zero-shot: greedy + this many samples
    train_eval_tasks: Count = 16  # training tasks the per-round zero-shot ratio (vs their best heuristic) is measured on
    # members of the trained families never trained on (agent.distribution.draw_validation): the final
    # model.zip is the policy (initial one included) with the best zero-shot ratio on them; 0: the last round's
    validation_tasks: Count = 4


class CallbacksSection(Section):
    """``callbacks``: evaluation / checkpoint frequencies (in steps), heuristic baselines."""

    eval_freq: PositiveInt = 2048
    checkpoint_freq: PositiveInt = 10_000
    baselines: bool = True
    n_eval_episodes: PositiveInt | None = None


class ImitationSection(Section):
    """``imitation``: the behaviour-cloning warm start (:mod:`agent.imitation`)."""

    epochs: PositiveInt = 20
    batch_size: PositiveInt = 128
    learning_rate: Number = Field(BC_LEARNING_RATE, gt=0)


class SelfImitationSection(Section):
    """``self_imitation``: clone the best plan so far between PPO updates (:mod:`agent.self_imitation`)."""

    every: PositiveInt = SELF_IMITATION["every"]
    epochs: PositiveInt = SELF_IMITATION["epochs"]
    batch_size: PositiveInt = SELF_IMITATION["batch_size"]
    learning_rate: Number = Field(BC_LEARNING_RATE, gt=0)


def _true_means_defaults(value: Any) -> Any:
    """``section: true`` means the section with its defaults; ``false`` / empty means no section."""
    if value is True:
        return {}
    if value is False or value == {} or value is None:
        return None
    return value


class TrainSpec(Section):
    """A whole training config."""

    name: str | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    n_envs: Annotated[int, Field(ge=1, le=64)] = 1
    total_timesteps: PositiveInt = 10_000
    env: EnvSection = Field(default_factory=EnvSection)
    tasks: TasksSection
    eval_tasks: TasksSection | None = None
    policy: PolicySection = Field(default_factory=PolicySection)
    ppo: PPOSection = Field(default_factory=PPOSection)
    callbacks: CallbacksSection = Field(default_factory=CallbacksSection)
    imitation: Annotated[ImitationSection | None, BeforeValidator(_true_means_defaults)] = None
    self_imitation: Annotated[SelfImitationSection | None, BeforeValidator(_true_means_defaults)] = None
    expert_iteration: Annotated[ExpertIterationSection | None, BeforeValidator(_true_means_defaults)] = None

    @model_validator(mode="after")
    def _iteration_needs_a_distribution(self) -> TrainSpec:
        if self.expert_iteration is not None and self.tasks.distribution is None:
            raise ValueError("expert_iteration needs tasks.distribution (the tasks it draws and searches)")
        if self.tasks.distribution is not None and self.expert_iteration is None:
            raise ValueError("tasks.distribution is trained with an expert_iteration section")
        return self

    @field_validator("env", "policy", "ppo", "callbacks", mode="before")
    @classmethod
    def _empty_is_default(cls, v: Any) -> Any:
        return {} if v is None else v


def check_batch_size(spec: TrainSpec) -> str | None:
    """Why ``ppo.batch_size`` does not fit one rollout (``n_steps * n_envs`` steps), or None when it does."""
    buffer = spec.ppo.n_steps * spec.n_envs
    if spec.ppo.batch_size > buffer:
        return (f"ppo.batch_size: must be at most ppo.n_steps * n_envs = {spec.ppo.n_steps} * {spec.n_envs} "
                f"= {buffer} (one rollout), got {spec.ppo.batch_size}")
    return None


__all__ = ["TrainSpec", "PPOSection", "EnvSection", "PolicySection", "TasksSection", "CallbacksSection",
           "ImitationSection", "SelfImitationSection", "DistributionSection", "ExpertIterationSection",
           "check_batch_size"]
