"""``adapt ops``: the JSON contract, config-only giants, and bad input as one line with exit code 2."""

from __future__ import annotations

import json

from adapt.app.cli import main


def run_cli(capsys, *argv):
    code = main(["ops", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_ops_json_contract(zoo, capsys):
    code, out, err = run_cli(capsys, str(zoo("qwen3")), "--json", "--no-onnx")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) >= {"components", "ops", "coverage", "new", "onnx"}
    assert all(set(c) >= {"module", "kind", "provider", "kernel", "status"} for c in data["components"])
    assert all(set(o) >= {"overload", "count", "status"} for o in data["ops"])
    cov = data["coverage"]
    assert cov["unmapped"] == 0 and cov["ops_total"] == sum(o["count"] for o in data["ops"])
    assert abs(sum(cov["share_by_status"].values()) - 1.0) < 1e-3
    assert 0.0 < cov["flops_share_fused_or_native"] <= 1.0
    assert data["new"] == [] and data["patch_check"]["passed"]


def test_ops_with_onnx_and_restricted_profile_table(zoo, capsys, tmp_path):
    code, out, err = run_cli(capsys, str(zoo("llama")), "--profile", "npu-restricted", "--out", str(tmp_path))
    assert code == 0, err
    assert "components" in out and "decomposed" in out and "onnx: exported=True" in out
    report = json.loads((tmp_path / "ops.json").read_text())
    assert report["onnx"]["checker"] == "ok" and (tmp_path / "model.onnx").is_file()
    assert report["profile"]["name"] == "npu-restricted"
    import onnx

    graph = onnx.load(str(tmp_path / "model.onnx")).graph  # the op graph: weights are inputs, not data
    assert not graph.initializer and any(i.name != "input_ids" for i in graph.input)


def test_config_only_deepseek_v3_through_the_cli(capsys, tmp_path):
    from test_ops_inventory import DEEPSEEK_V3_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    code, out, err = run_cli(capsys, str(tmp_path), "--config-only", "--json")
    assert code == 0, err
    data = json.loads(out)
    kinds = {(c["module"], c["kind"]) for c in data["components"]}
    assert ("model.layers.3.mlp", "moe") in kinds and ("model.layers.0.self_attn", "attention") in kinds
    assert data["coverage"]["unmapped"] == 0 and data["traced_blocks"] == ["model.layers.0", "model.layers.3"]
    assert not data["patch_check"]["ran"]


def test_bad_inputs_exit_2_with_one_line(zoo, capsys, tmp_path):
    code, out, err = run_cli(capsys, str(tmp_path / "missing"))
    assert code == 2 and err.startswith("adapt: error:") and "Traceback" not in err
    code, out, err = run_cli(capsys, str(zoo("llama")), "--profile", "no-such-npu", "--no-onnx")
    assert code == 2 and "unknown profile" in err and len(err.strip().splitlines()) == 1
