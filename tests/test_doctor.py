import json

import pytest

from aisrl.cli import main
from aisrl.doctor import DoctorConfig, diagnose, table
from aisrl.models import tiny_model


def test_doctor_orders_formats_by_precision():
    cfg = DoctorConfig(model="tiny-llama", formats=["bf16", "fp8_e4m3_w8a8", "mxfp4"], prompts=6, max_new_tokens=10)
    res = diagnose(cfg, tiny_model("tiny-llama", seed=1), None)
    assert list(res) == cfg.formats
    for r in res.values():
        assert r["tokens"] == 60 and len(r["log_ratios"]) == 60 and 0 < r["ess"] <= 1
    # coarser formats pull the rollout further from the trainer
    assert res["bf16"]["k3_kl"] < res["fp8_e4m3_w8a8"]["k3_kl"] < res["mxfp4"]["k3_kl"]
    assert "| fp8_e4m3_w8a8 | 60 |" in table(res)


def test_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "doc"
    rc = main(["mismatch", "--model", "tiny-qwen2", "--formats", "fp8_e4m3,int4", "--out", str(out),
               "prompts=3", "max_new_tokens=5"])  # fmt: skip
    assert rc == 0
    data = json.loads((out / "mismatch.json").read_text())
    assert set(data["formats"]) == {"fp8_e4m3", "int4"} and data["config"]["prompts"] == 3
    assert (out / "logratio_hist.png").stat().st_size > 1000


def test_unknown_format_fails_before_loading(capsys):
    assert main(["mismatch", "--model", "tiny-llama", "--formats", "fp7"]) == 2
    assert "unknown quantisation preset 'fp7'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown task"):
        diagnose(DoctorConfig(model="tiny-llama", task="chess"), tiny_model(), None)
    assert main(["mismatch", "--preset", "lab", "--model", "tiny-llama", "temperature=0.7"]) == 2
    assert "with a preset, ['model', 'temperature'] come from the preset ('lab')" in capsys.readouterr().err
    assert main(["mismatch", "--preset", "lab", "--model", "smollm2", "--task", "arithmetic"]) == 2  # the defaults too
    assert "with a preset, ['model', 'task'] come from the preset ('lab')" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["causal", "diffusion"])
def test_preset_diagnoses_the_lab_models_as_their_trainer_scores_them(tmp_path, monkeypatch, kind):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    gen = "{max_new_tokens: 40}" if kind == "diffusion" else "{max_new_tokens: 8}"
    (tmp_path / "tiny.yaml").write_text(
        f"model: {{name: lab, kind: {kind}}}\n"
        "lab: {task: sudoku4, hidden: 32, layers: 1, sft_steps: 0}\n"
        f"rollout: {gen}\ndiffusion: {{block_length: 8, steps: 5}}\n"
    )
    cfg = DoctorConfig(preset=str(tmp_path / "tiny.yaml"), formats=["fp8_e4m3_w8a8", "mxfp4_w4a4"], prompts=4)
    res = diagnose(cfg)
    for r in res.values():
        assert 0 < r["tokens"] <= 4 * 40 and len(r["log_ratios"]) == r["tokens"]
    assert 0 < res["fp8_e4m3_w8a8"]["k3_kl"] < res["mxfp4_w4a4"]["k3_kl"]
