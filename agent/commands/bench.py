"""`rlplace bench --suite NAME|path.yaml [--policy CKPT | --no-agent] [--ray | --ray-address ADDR] [--out DIR]`:
every placer and the trained agent on every case of a benchmark suite; writes results.csv, results.md,
ratios.png, Gantt charts and the best plans."""

from __future__ import annotations

import typer

from agent.placers.common import Budget


def _fail(message: str):
    from agent.benchmark.suite import SuiteError

    raise SuiteError(message)


def bench_cmd(
    suite: str = typer.Option("default", "--suite", "-s", help="suite name (the checkout's experiments/suites/NAME.yaml) or yaml path"),
    policy: str = typer.Option(None, "--policy", help="policy checkpoint for the agent columns (default: the suite's, "
                               "else the shipped policy); turns the agent columns on for a suite without an agent section"),
    no_agent: bool = typer.Option(False, "--no-agent", help="leave out the agent columns (policy, policy+search)"),
    agent_samples: int = typer.Option(None, "--agent-samples", help="sampled rollouts besides the greedy one for the "
                                      "policy column (replaces the suite's)"),
    agent_evaluations: int = typer.Option(None, "--agent-evaluations", help="evaluations of policy-guided search for the "
                                          "policy+search column (replaces the suite's; 0: no such column)"),
    budget_seconds: float = typer.Option(None, "--budget-seconds", min=0.001, max=86_400.0, help="wall-clock budget per search placer and case "
                                         "(replaces the suite's budget; results then depend on machine speed)"),
    budget_evaluations: int = typer.Option(None, "--budget-evaluations", min=1, help="simulator evaluations per search placer "
                                           "and case (replaces the suite's budget)"),
    ray: bool = typer.Option(False, "--ray", help="run the cases as tasks on a local Ray instance (pip install 'rlplace[scale]')"),
    ray_address: str = typer.Option(None, "--ray-address", help="run the cases on the Ray cluster at HOST:PORT (or 'auto')"),
    num_cpus: int = typer.Option(None, "--num-cpus", help="workers of a local Ray instance (default: all cores)"),
    out: str = typer.Option("experiments/results", "--out", "-o", help="output folder"),
    no_gantt: bool = typer.Option(False, "--no-gantt", help="skip the Gantt charts of the best plans"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Benchmark the placers and the agent on a suite of cases against lower bounds. Bad input (a bad
    suite, a missing policy, an unreachable Ray cluster) exits 2 with one line and writes nothing."""
    from dataclasses import replace

    from agent.benchmark.runner import check_agent, effective_agent, run_suite
    from agent.benchmark.suite import AgentSettings, load_suite
    from agent.scale import Executor
    from envs.files import check_output_dir

    if no_agent and (policy is not None or agent_samples is not None or agent_evaluations is not None):
        _fail("--no-agent cannot be combined with --policy, --agent-samples or --agent-evaluations")
    if agent_samples is not None and agent_samples < 0:
        _fail(f"--agent-samples must be >= 0, got {agent_samples}")
    if agent_evaluations is not None and agent_evaluations < 0:
        _fail(f"--agent-evaluations must be >= 0, got {agent_evaluations}")
    if num_cpus is not None and num_cpus < 1:
        _fail(f"--num-cpus must be >= 1, got {num_cpus}")
    check_output_dir(out, "output folder")
    s = load_suite(suite)
    budget = None
    if budget_seconds is not None or budget_evaluations is not None:
        budget = Budget(seconds=budget_seconds, evaluations=budget_evaluations)
    agent = effective_agent(s, False if no_agent else None, policy)
    if agent is None and (agent_samples is not None or agent_evaluations is not None):
        agent = AgentSettings()  # asking for agent settings turns the agent on
    if agent is not None:
        agent = replace(agent, **{k: v for k, v in (("samples", agent_samples), ("evaluations", agent_evaluations))
                                  if v is not None})
    check_agent(agent)  # a missing or corrupt policy: one line before any work
    with Executor(ray=ray, address=ray_address, num_cpus=num_cpus) as ex:  # Ray is reached before anything is written
        rows = run_suite(s, out, budget=budget, agent=agent or False, executor=ex, log=typer.echo,
                         gantt=not no_gantt, progress=not quiet)
    typer.echo(f"{len(rows)} results for {len({r.case for r in rows})} cases written to {out}/results.md, "
               f"results.csv, ratios.png")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)
