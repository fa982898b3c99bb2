"""Training faults: a bad config is one line and exit 2 before anything is written; models are saved
atomically (a kill never leaves a broken file under a final name); ``--resume`` picks the newest model
that loads, by step count, and continues TensorBoard and ``evaluations.npz``; Ctrl-C leaves a resumable
checkpoint and exit code 130. Tiny configs (one small graph, 64-step rollouts) keep each run seconds."""

from __future__ import annotations

import copy
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("sb3_contrib")

from sb3_contrib import MaskablePPO  # noqa: E402

from agent.train import TrainError, TrainingInterrupted, load_config, pick_checkpoint, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DROP = object()  # an override that removes the key

FAST = {
    "name": "faults",
    "seed": 0,
    "n_envs": 1,
    "total_timesteps": 128,
    "env": {"max_nodes": 8, "max_devices": 4},
    "tasks": {"builtin": ["gpt-tiny"], "topologies": ["pcie-4gpu"]},
    "policy": {"hidden": 16, "rounds": 1, "device_rounds": 1, "value_hidden": 16, "dynamic_rounds": 0},
    "ppo": {"n_steps": 64, "batch_size": 32, "n_epochs": 1},
    "callbacks": {"eval_freq": 64, "checkpoint_freq": 64, "baselines": False},
}


def config(**overrides) -> dict:
    """FAST with sections merged (a dict into a dict section) or replaced; DROP removes a key."""
    out = copy.deepcopy(FAST)
    for key, value in overrides.items():
        if value is DROP:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def write(tmp_path: Path, cfg: dict | str | bytes, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    if isinstance(cfg, bytes):
        path.write_bytes(cfg)
    else:
        path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False))
    return path


def loads(path: Path) -> bool:
    try:
        MaskablePPO.load(path, device="cpu")
    except Exception:  # noqa: BLE001
        return False
    return True


# ---------------------------------------------------------------------- bad configs
BAD = [  # (overrides of FAST, the one-line error after "<file>: ")
    ({"n_envs": "two"}, "n_envs: Input should be a valid integer, got 'two'"),
    ({"n_envs": 0}, "n_envs: Input should be greater than or equal to 1, got 0"),
    ({"n_envs": 65}, "n_envs: Input should be less than or equal to 64, got 65"),
    ({"n_envs": 1.5}, "n_envs: Input should be a valid integer"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"total_timesteps": 0}, "total_timesteps: Input should be greater than or equal to 1"),
    ({"learning_rate": 0.1}, "learning_rate: unknown key"),
    ({"ppo": {"learning_rate": "fast"}}, "ppo.learning_rate: Input should be a valid number, got 'fast'"),
    ({"ppo": {"learning_rate": 0.0}}, "ppo.learning_rate: Input should be greater than 0"),
    ({"ppo": {"learning_rate": float("nan")}}, "ppo.learning_rate: Input should be a finite number"),
    ({"ppo": {"learning_rate": float("inf")}}, "ppo.learning_rate: Input should be a finite number"),
    ({"ppo": {"batch_size": 0}}, "ppo.batch_size: Input should be greater than or equal to 2, got 0"),
    ({"ppo": {"batch_size": 1}}, "ppo.batch_size: Input should be greater than or equal to 2, got 1"),
    ({"ppo": {"batch_size": 128}}, "ppo.batch_size: must be at most ppo.n_steps * n_envs = 64 * 1 = 64"),
    ({"ppo": {"n_steps": 0}}, "ppo.n_steps: Input should be greater than or equal to 1"),
    ({"ppo": {"n_epochs": 0}}, "ppo.n_epochs: Input should be greater than or equal to 1"),
    ({"ppo": {"gamma": 1.5}}, "ppo.gamma: Input should be less than or equal to 1"),
    ({"ppo": {"gae_lambda": -0.1}}, "ppo.gae_lambda: Input should be greater than or equal to 0"),
    ({"ppo": {"clip_range": 0}}, "ppo.clip_range: Input should be greater than 0"),
    ({"ppo": {"ent_coef": -1}}, "ppo.ent_coef: Input should be greater than or equal to 0"),
    ({"ppo": {"vf_coef": True}}, "ppo.vf_coef: Input should be a valid number"),
    ({"ppo": {"max_grad_norm": 0}}, "ppo.max_grad_norm: Input should be greater than 0"),
    ({"ppo": {"lr": 0.1}}, "ppo.lr: unknown key"),
    ({"env": {"max_node": 8}}, "env.max_node: unknown key"),
    ({"env": {"max_nodes": 0}}, "env.max_nodes: Input should be greater than or equal to 1"),
    ({"env": {"max_nodes": "8"}}, "env.max_nodes: Input should be a valid integer, got '8'"),
    ({"env": {"mode": "fly"}}, "env.mode: Input should be 'place' or 'refine', got 'fly'"),
    ({"env": {"objective": "speed"}}, "env.objective: Input should be"),
    ({"env": {"coarsen": 1}}, "env.coarsen: Input should be a valid boolean"),
    ({"env": {"microbatch_choices": [0]}}, "env.microbatch_choices[0]: Input should be greater than or equal to 1"),
    ({"env": {"microbatch_choices": []}}, "env.microbatch_choices: List should have at least 1 item"),
    ({"env": {"eval_graph": "medium"}}, "env.eval_graph: Input should be 'coarse' or 'fine'"),
    ({"env": {"task_cache_size": 0}}, "env.task_cache_size: Input should be greater than or equal to 1"),
    ({"policy": {"hiden": 8}}, "policy.hiden: unknown key"),
    ({"policy": {"hidden": 0}}, "policy.hidden: Input should be greater than or equal to 1"),
    ({"policy": {"prior": [1.0]}}, "policy.prior: needs 3 weights (one per option-state column)"),
    ({"callbacks": {"checkpoint_freq": 0}}, "callbacks.checkpoint_freq: Input should be greater than or equal to 1"),
    ({"callbacks": {"eval_freq": -5}}, "callbacks.eval_freq: Input should be greater than or equal to 1"),
    ({"callbacks": {"eval_every": 5}}, "callbacks.eval_every: unknown key"),
    ({"callbacks": {"baselines": "maybe"}}, "callbacks.baselines: Input should be a valid boolean"),
    ({"tasks": DROP}, "tasks: missing (required)"),
    ({"tasks": {"builtins": ["gpt-tiny"]}}, "tasks.builtins: unknown key"),
    ({"tasks": {"builtin": "gpt-tiny"}}, "tasks.builtin: Input should be a valid list"),
    ({"tasks": {"batches": [0]}}, "tasks.batches[0]: Input should be greater than or equal to 1"),
    ({"tasks": {"size": "huge"}}, "tasks.size: Input should be"),
    ({"tasks": {"builtin": []}}, "tasks: needs 'builtin', 'specs', 'families' or 'distribution'"),
    ({"eval_tasks": {"builtin": ["moe-wide"], "topology": "pcie-4gpu"}}, "eval_tasks.topology: unknown key"),
    ({"imitation": {"epoch": 3}}, "imitation.epoch: unknown key"),
    ({"imitation": {"epochs": 0}}, "imitation.epochs: Input should be greater than or equal to 1"),
    ({"imitation": 5}, "imitation: Input should be a valid dictionary"),
    ({"self_imitation": {"every": "x"}}, "self_imitation.every: Input should be a valid integer, got 'x'"),
    ({"self_imitation": [1, 2]}, "self_imitation: Input should be a valid dictionary"),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[e.split(":")[0] + f"-{i}" for i, (_, e) in enumerate(BAD)])
def test_bad_config_is_one_line_naming_the_field(tmp_path, overrides, expected):
    path = write(tmp_path, config(**overrides))
    with pytest.raises(TrainError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {expected}"), msg


def test_good_configs_and_yaml_leniency(tmp_path):
    """The shipped configs validate; ``3e-4`` (a string to PyYAML) is the number it means; ``true``
    means a section's defaults; the properties keep their defaults."""
    for path in sorted((ROOT / "experiments" / "configs").glob("*.yaml")):
        load_config(path)
    text = yaml.safe_dump(config(self_imitation=True, imitation=True, ppo=DROP))
    cfg = load_config(write(tmp_path, text + "ppo: {n_steps: 64, batch_size: 32, n_epochs: 1, learning_rate: 3e-4}\n"))
    assert cfg.ppo["learning_rate"] == 3e-4 and cfg.ppo["gamma"] == 1.0 and cfg.ppo["clip_range"] == 0.2
    assert cfg.self_imitation == {"every": 4, "epochs": 5, "batch_size": 128, "learning_rate": 3e-3}
    assert cfg.imitation == {"epochs": 20, "batch_size": 128, "learning_rate": 3e-3}
    assert cfg.callbacks == {"eval_freq": 64, "checkpoint_freq": 64, "baselines": False, "n_eval_episodes": None}
    assert cfg.env == {"max_nodes": 8, "max_devices": 4, "objective": "step_time", "order": "topological"}
    assert (cfg.n_envs, cfg.seed, cfg.total_timesteps, cfg.name) == (1, 0, 128, "faults")
    off = load_config(config(self_imitation=False, imitation=None, eval_tasks=None))
    assert off.self_imitation is None and off.imitation is None


BAD_FILES = {
    "broken yaml": (b"tasks: {builtin: [gpt-tiny}\n", "is not valid YAML (line 1"),
    "not utf-8": (b"tasks: \xff\xfe\n", "is not UTF-8 text"),
    "not a mapping": (b"- 1\n- 2\n", "a training config must be a mapping of sections, got list"),
    "empty": (b"", "tasks: missing (required)"),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_config_file_is_one_line(tmp_path, kind):
    data, expected = BAD_FILES[kind]
    path = write(tmp_path, data)
    with pytest.raises(TrainError) as exc:
        load_config(path)
    assert "\n" not in str(exc.value) and str(path) in str(exc.value) and expected in str(exc.value)


def test_missing_or_directory_config_is_one_line(tmp_path):
    with pytest.raises(TrainError, match=r"^training config not found: .*nope\.yaml$"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(TrainError, match=r"is a directory, not a file$"):
        load_config(tmp_path)


BAD_TASKS = [  # found only when the tasks / environments are built: still before the run directory
    ({"tasks": {"builtin": ["no-such-graph"]}}, "tasks: no built-in graph 'no-such-graph'"),
    ({"tasks": {"topologies": ["no-such-box"]}}, "tasks: unknown topology 'no-such-box'"),
    ({"tasks": {"families": ["no-such-family"], "builtin": None}}, "tasks: unknown model family"),
    ({"eval_tasks": {"builtin": ["no-such-graph"]}}, "eval_tasks: no built-in graph 'no-such-graph'"),
    ({"env": {"max_devices": 2}}, "env: task 'gpt-tiny@pcie-4gpu': topology 'pcie-4gpu' has 4 devices"),
    ({"env": {"max_devices": 2}, "n_envs": 2}, "env: task 'gpt-tiny@pcie-4gpu': topology 'pcie-4gpu' has 4"),
]


@pytest.mark.parametrize("overrides,expected", BAD_TASKS)
def test_bad_tasks_fail_before_the_run_dir(tmp_path, overrides, expected):
    path = write(tmp_path, config(**overrides))
    run = tmp_path / "run"
    with pytest.raises(TrainError) as exc:
        train(path, run_dir=run, progress=False, log=None)
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"{path}: {expected}"), str(exc.value)
    assert not run.exists()


def test_resume_without_a_run_or_a_loadable_model(tmp_path):
    path = write(tmp_path, FAST)
    with pytest.raises(TrainError, match="no run directory"):
        train(path, run_dir=tmp_path / "none", resume=True, progress=False, log=None)
    assert not (tmp_path / "none").exists()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model.zip").write_bytes(b"")
    (run / "checkpoints" / "model_64_steps.zip").write_bytes(b"PK\x03\x04 truncated")
    said: list[str] = []
    with pytest.raises(TrainError) as exc:
        pick_checkpoint(run, said.append)
    assert "\n" not in str(exc.value) and "(2 did not load)" in str(exc.value)
    assert len(said) == 2 and all(s.startswith("warning: skipping") for s in said)


# ---------------------------------------------------------------------- the command line
CLI_BAD = [
    (["--config", "{cfg}"], {"ppo": {"batch_size": 0}}, "ppo.batch_size: Input should be greater than or equal to 2"),
    (["--config", "{cfg}"], {"env": {"max_node": 8}}, "env.max_node: unknown key"),
    (["--config", "{cfg}"], {"tasks": {"builtin": ["no-such-graph"]}}, "tasks: no built-in graph"),
    (["--config", "{dir}"], {}, "is a directory, not a file"),
    (["--config", "{cfg}", "--total-steps", "0"], {}, None),
    (["--config", "{cfg}", "--total-steps", "-3"], {}, None),
]


@pytest.mark.parametrize("args,overrides,expected", CLI_BAD)
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, overrides, expected):
    from agent.cli import main

    cfg = write(tmp_path, config(**overrides))
    run = tmp_path / "run"
    argv = ["train", *[a.format(cfg=cfg, dir=tmp_path) for a in args], "--run-dir", str(run), "--no-progress"]
    try:
        code = main(argv)
    except SystemExit as exc:  # pragma: no cover - main returns its code
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and not run.exists()
    if expected is not None:  # bad input: one line; usage errors show typer's usage lines
        assert err.count("\n") == 1 and err.startswith("error:") and expected in err, err


def test_cli_process_exit_code_2(tmp_path):
    """The real process: exit code 2, one ``error:`` line, no traceback, no run directory."""
    cfg = write(tmp_path, config(n_envs="two"))
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "agent.cli", "train", "--config", str(cfg), "--run-dir", str(run)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error:") and "n_envs" in out.stderr
    assert "Traceback" not in out.stderr and not run.exists()


# ---------------------------------------------------------------------- kills, resumes, Ctrl-C
def _final_zips(run: Path) -> list[Path]:
    names = [run / "model.zip", *run.glob("checkpoints/model_*_steps.zip"), run / "best" / "best_model.zip"]
    return [p for p in names if p.exists()]


def _resumed_from(lines: list[str]) -> tuple[str, int]:
    m = next(re.match(r"resuming (\S+) at step (\d+)$", s) for s in lines if s.startswith("resuming"))
    return Path(m.group(1)).name, int(m.group(2))


def test_sigkill_during_a_save_then_resume_skips_broken_files(tmp_path):
    """A run saving a checkpoint every step is SIGKILLed while a save's temporary file exists: no file
    under a final name is broken. With a truncated newer checkpoint and a 0-byte model.zip added,
    --resume warns about both, continues from the newest valid checkpoint and reaches the target;
    afterwards every zip in the run loads (broken ones set aside, unfinished saves removed)."""
    cfg = write(tmp_path, config(total_timesteps=10**6, callbacks={"checkpoint_freq": 1}))
    run = tmp_path / "run"
    ck = run / "checkpoints"
    code = f"from agent.train import train; train({str(cfg)!r}, run_dir={str(run)!r}, progress=False, log=None)"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while True:
            names = os.listdir(ck) if ck.is_dir() else []
            if sum(n.endswith("_steps.zip") for n in names) >= 3 and any(n.startswith(".") for n in names):
                break  # a save is in progress
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "no checkpoints"
            time.sleep(0.002)
    finally:
        proc.kill()  # SIGKILL
        proc.wait(timeout=60)
    assert all(loads(p) for p in _final_zips(run))
    steps = sorted(int(re.search(r"_(\d+)_", p.name).group(1)) for p in ck.glob("model_*_steps.zip"))
    newest = steps[-1]
    good = ck / f"model_{newest}_steps.zip"
    broken = ck / f"model_{newest + 1000}_steps.zip"
    broken.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (run / "model.zip").write_bytes(b"")
    saved = yaml.safe_load((run / "config.yaml").read_text())  # the resumed run saves less often (faster)
    saved["callbacks"]["checkpoint_freq"] = 32
    (run / "config.yaml").write_text(yaml.safe_dump(saved))

    said: list[str] = []
    res = train(cfg, run_dir=run, total_steps=newest + 64, resume=True, progress=False, log=said.append)
    assert _resumed_from(said) == (good.name, newest)
    warned = [s for s in said if s.startswith("warning: skipping")]
    assert len(warned) == 2 and any(broken.name in s for s in warned) and any("model.zip" in s for s in warned)
    assert res.num_timesteps >= newest + 64
    assert MaskablePPO.load(run / "model.zip", device="cpu").num_timesteps == res.num_timesteps
    assert all(loads(p) for p in run.rglob("*.zip"))
    assert not list(run.rglob(".*.tmp.*"))
    assert (ck / f"{broken.name}.corrupt").exists() and (run / "model.zip.corrupt").exists()


def test_resume_prefers_newer_checkpoint_and_continues_evaluations_and_curve(tmp_path):
    """model.zip older than the newest checkpoint is not picked; evaluations.npz and the TensorBoard
    curve continue from the resumed step (entries beyond it, from steps trained again, are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = write(tmp_path, config(total_timesteps=256, eval_tasks={"builtin": ["mlp-chain"],
                                                                  "topologies": ["pcie-4gpu"]}))
    run = tmp_path / "run"
    train(cfg, run_dir=run, progress=False, log=None)
    ck = run / "checkpoints"
    assert np.load(run / "eval" / "evaluations.npz")["timesteps"].tolist() == [64, 128, 192, 256]
    shutil.copy(ck / "model_128_steps.zip", run / "model.zip")  # a stale model.zip
    (ck / "model_256_steps.zip").unlink()  # the newest checkpoint is lost: resume from 192
    said: list[str] = []
    res = train(cfg, run_dir=run, total_steps=320, resume=True, progress=False, log=said.append)
    assert _resumed_from(said) == ("model_192_steps.zip", 192)
    assert res.num_timesteps == 320
    ev = np.load(run / "eval" / "evaluations.npz")
    assert ev["timesteps"].tolist() == [64, 128, 192, 256, 320]
    assert ev["results"].shape == (5, 1) and ev["ep_lengths"].shape == (5, 1)
    assert sorted(p.name for p in (run / "tb").iterdir()) == ["PPO_1"]
    acc = EventAccumulator(str(run / "tb" / "PPO_1"))
    acc.Reload()
    fps = [e.step for e in acc.Scalars("time/fps")]
    assert fps == sorted(set(fps)) and fps[-1] == 320 and fps[0] == 64, fps
    assert loads(run / "best" / "best_model.zip")


def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path, monkeypatch):
    """KeyboardInterrupt at step 100 (mid-rollout): a loadable checkpoint at step 100, a message saying
    how to resume; the resumed run continues from it."""
    import agent.callbacks as cbs

    class Interrupt(cbs.HParamCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps >= 100:
                raise KeyboardInterrupt
            return True

    monkeypatch.setattr(cbs, "HParamCallback", Interrupt)
    cfg = write(tmp_path, config(total_timesteps=256))
    run = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as exc:
        train(cfg, run_dir=run, progress=True, log=None)
    assert isinstance(exc.value, KeyboardInterrupt) and exc.value.num_timesteps == 100
    ck = run / "checkpoints" / "model_100_steps.zip"
    assert exc.value.checkpoint == ck and MaskablePPO.load(ck, device="cpu").num_timesteps == 100
    msg = str(exc.value)
    assert "\n" not in msg and str(ck) in msg
    assert f"rlplace train --config {cfg} --run-dir {run} --resume" in msg
    assert not (run / "model.zip").exists()
    monkeypatch.undo()
    said: list[str] = []
    res = train(cfg, run_dir=run, total_steps=192, resume=True, progress=False, log=said.append)
    assert _resumed_from(said) == ("model_100_steps.zip", 100) and res.num_timesteps >= 192


def _default_sigint() -> None:
    """In the child before it runs: Ctrl-C's default action, as a terminal gives it. A shell without job
    control starts background commands with SIGINT ignored (``.ci/run &``), Popen children inherit that,
    and Python then leaves it ignored: the Ctrl-C below would be lost and training would run on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_ctrl_c_with_subprocess_workers_exits_130(tmp_path):
    """SIGINT to the whole process group (as a terminal's Ctrl-C) of ``rlplace train`` with two
    SubprocVecEnv workers: exit 130, one line naming the checkpoint, no traceback from any process."""
    cfg = write(tmp_path, config(n_envs=2, total_timesteps=10**6, callbacks={"checkpoint_freq": 128}))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "train", "--config", str(cfg), "--run-dir", str(run),
                             "--no-progress"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=_default_sigint)
    try:
        deadline = time.time() + 120
        while not glob.glob(str(run / "checkpoints" / "model_*_steps.zip")):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            _out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
            os.kill(proc.pid, signal.SIGABRT)
            time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)  # the forked workers hold the stderr pipe too
            _out, err = proc.communicate(timeout=30)
            raise AssertionError(f"no exit 120 s after Ctrl-C; stacks:\n{err[-8000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "resume with: rlplace train" in err, err
    m = re.search(r"checkpoint saved to (\S+);", err)
    assert m and loads(Path(m.group(1)))


def test_closing_an_interrupted_subprocess_env_reads_nothing_from_its_workers():
    """After Ctrl-C inside a SubprocVecEnv step, a worker's answer may be half read: reading its pipe again
    would take the rest for a length header and wait forever. ``_close_quietly`` tells every worker to
    close without reading, and terminates one that does not end."""
    from agent.train import _close_quietly

    class Remote:
        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

        def recv(self):
            raise AssertionError("read from a worker's pipe")

        poll = recv

    class Process:
        def __init__(self, ends: bool):
            self.ends, self.terminated = ends, False

        def join(self, timeout=None):
            pass

        def is_alive(self):
            return not (self.ends or self.terminated)

        def terminate(self):
            self.terminated = True

    class Env:
        waiting, closed = True, False

        def close(self):
            raise AssertionError("SB3's close reads every pending answer")

    env = Env()
    env.remotes, env.processes = [Remote(), Remote()], [Process(True), Process(False)]
    _close_quietly(env)
    assert all(r.sent == [("close", None)] for r in env.remotes)
    assert [p.terminated for p in env.processes] == [False, True] and env.closed and not env.waiting
