import json

import pytest

from envs.examples import transformer_graph
from envs.plan import megatron_plan
from envs.presets import preset


def test_simulate_default_compares_standard_plans(cli):
    code, out, _ = cli("simulate")
    assert code == 0
    assert "single device" in out and "data parallel x8" in out and "megatron tp8" in out


def test_simulate_megatron_json_and_gantt(cli, tmp_path):
    png = tmp_path / "g.png"
    code, out, _ = cli("simulate", "--tp", "2", "--pp", "2", "--dp", "2", "--microbatch-size", "1",
                       "--json", "--gantt", str(png))
    assert code == 0
    d = json.loads(out)
    assert d["objective"] == "step_time" and d["value_s"] > 0 and len(d["peak_memory_bytes"]) == 8 and d["oom"] is False
    assert png.stat().st_size > 1000


def test_simulate_plan_file(cli, tmp_path):
    g = transformer_graph(layers=2, hidden=256, seq=128, batch=4)
    g.save(tmp_path / "g.json")
    megatron_plan(g, preset("dgx-a100-80g"), pp=2, microbatch_size=1, global_batch=4).save(tmp_path / "p.json")
    code, out, _ = cli("simulate", "--graph", str(tmp_path / "g.json"), "--plan", str(tmp_path / "p.json"),
                       "--json")
    assert code == 0 and json.loads(out)["value_s"] > 0


@pytest.mark.parametrize("args, message", [
    (("--graph", "missing.json"), "not found"),
    (("--topology", "dgx-z"), "unknown topology"),
    (("--tp", "16"), "exceeds"),
    (("--objective", "speed"), "unknown objective"),
    (("--schedule", "zigzag", "--tp", "2"), "unknown schedule"),
    (("--plan", "nope.json"), "plan file not found"),
])
def test_simulate_bad_input_exit_2(cli, args, message):
    code, out, err = cli("simulate", *args)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_topology_show(cli):
    code, out, _ = cli("topology", "show", "dgx1-v100")
    assert code == 0 and "pairwise" in out


def test_simulate_saves_the_best_plan(cli, tmp_path):
    out = tmp_path / "best.json"
    code, _, _ = cli("simulate", "--save-plan", str(out))
    assert code == 0
    from envs.plan import Plan

    plan = Plan.load(out)
    assert plan.provenance["name"] and plan.provenance["predicted_step_time"] > 0
