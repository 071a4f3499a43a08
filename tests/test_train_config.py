"""The training config's loading and derived settings: presets and YAML files, the device, the task's and the
correction's options (cases by hand, each one a slip in aisrl.train_config that other tests let pass)."""

import json

import pytest
import torch

from aisrl.train_checks import validate
from aisrl.train_config import TrainConfig, correction_options, load_config, resolve_device, task_kwargs


def test_an_unknown_preset_is_not_called_a_run_folder_and_a_yaml_key_must_be_a_name(tmp_path):
    with pytest.raises(ValueError, match="unknown preset") as e:
        load_config("nonexistent-preset")
    assert "run's folder" not in str(e.value)
    (tmp_path / "u.yaml").write_text("lr: 0.1\n[a, b]: 1\n")  # before: TypeError (unhashable list), a traceback
    with pytest.raises(ValueError, match=r"u.yaml: a key must be a name, got \['a', 'b'\] \(line 2\)"):
        load_config(str(tmp_path / "u.yaml"))
    (tmp_path / "v.yaml").write_text("task: countdown\ntask_options: {x: {y: 1e-5}, z: [1e-3]}\n")
    assert load_config(str(tmp_path / "v.yaml")).task_options == {"x": {"y": 1e-5}, "z": [0.001]}  # as the CLI


def test_presets_read_numbers_as_the_command_line_does_and_a_recorded_config_reads_back_exactly(tmp_path):
    """YAML 1.1 would read `seed: 010` as 8 and `1:30` as 90, where the command line refuses both; it left `1e-5`
    text, and the old cure made every exponent-like text a float, so a recorded `{'tag': '1e5'}` read back as
    100000.0 and a resume was refused as a changed config (found by review)."""
    from dataclasses import asdict

    from aisrl.checkpoint import config_changes

    for text, message in (("seed: 010", "'seed' expects int, got '010'"), ("max_steps: 1:30", "got '1:30'")):
        (tmp_path / "p.yaml").write_text(text + "\n")
        with pytest.raises(ValueError, match=message):
            load_config(str(tmp_path / "p.yaml"))
        with pytest.raises(ValueError, match=message.split(",")[0]):
            load_config(None, [text.replace(": ", "=")])
    (tmp_path / "p.yaml").write_text("seed: 1_000\nlr: 5e-4\nmax_steps: 0x10\ntask_options: {a: '1e5', b: 2e3}\n")
    cfg = load_config(str(tmp_path / "p.yaml"))
    assert (cfg.seed, cfg.lr, cfg.max_steps, cfg.task_options) == (1000, 5e-4, 16, {"a": "1e5", "b": 2000.0})
    given = load_config(None, ["task_options={'tag': '1e5', 'lr': 1e-5}"])
    (tmp_path / "config.json").write_text(json.dumps(asdict(given)))
    back = load_config(str(tmp_path / "config.json"))
    assert back.task_options == {"tag": "1e5", "lr": 1e-5}
    assert config_changes(asdict(given), asdict(back)) == []


def test_devices_are_cpu_or_cuda_and_cuda_names_its_index(monkeypatch):
    for name in ("mps", "meta"):
        with pytest.raises(ValueError, match=f"device '{name}': the trainer runs on cpu or cuda"):
            resolve_device(name)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda:1")


def test_task_and_correction_options():
    cfg = load_config(None, ["task=reasoning_gym", "dataset=chain_sum", "task_options={'generator': 'x'}"])
    with pytest.raises(ValueError, match=r"task_options sets \['generator'\]"):
        task_kwargs(cfg)  # the generator is `dataset`: a second one in the options would be replaced silently
    assert correction_options(TrainConfig(), None) == {"cap": 2.0}  # no veto key while the veto is off
    assert correction_options(load_config(None, ["correction.name=none"]), None) == {}  # `none` takes no cap


@pytest.mark.parametrize("preset,overrides,message", [
    ("smollm2_arithmetic", ["lab.max_operand=50", " lab.task =countdown"],
     "lab.max_operand, lab.task would change nothing: lab.* keys set up model.name=lab, and 'smollm2' is another"),
    ("smollm2_arithmetic", ["diffusion.remasking=bogus"], "diffusion.remasking would change nothing"),
    ("lab", ["diffusion.steps=10"], "diffusion.steps would change nothing: .* this model is causal"),
    ("lab_columns", ["lora.targets=[nope]"], r"lora.targets would change nothing: .* lora.r=0 trains every weight"),
    ("lab", ["lora.alpha=8", "lora.dropout=0.1"], "lora.alpha, lora.dropout would change nothing"),
    ("lab", ["lab.task=countdown", "lab.ops=*"], r"lab.ops would change nothing: lab.task='countdown' reads no "
                                                 r"lab.\* task option"),
    ("lab", ["lab.sudoku_holes=3"], "lab.task='arithmetic' reads lab.max_operand, lab.ops, lab.trace"),
    ("diffusion_lab", ["lab.trace=columns"], "lab.trace would change nothing: lab.task='sudoku4' reads "
                                             "lab.sudoku_holes"),
])  # fmt: skip
def test_a_typed_key_the_run_would_not_read_is_refused(preset, overrides, message):
    """Accepted before and ignored, found by review."""
    with pytest.raises(ValueError, match=message):
        load_config(preset, overrides)


def test_the_keys_each_run_reads_are_accepted_and_a_presets_own_keys_are_no_slip():
    for preset, overrides in (("lab", ["lab.max_operand=30", "lab.ops=+", "lab.trace=columns"]),
                              ("lab", ["lab.task=sudoku4", "lab.sudoku_holes=4", "model.kind=diffusion",
                                       "diffusion.steps=24", "rollout.max_new_tokens=24", "diffusion.block_length=8"]),
                              ("smollm2_arithmetic", ["lora.r=4", "lora.alpha=8", "lora.targets=[q_proj]"]),
                              ("lab_columns", ["model.name=smollm2"])):  # fmt: skip  (the CLI's default preset)
        cfg = load_config(preset, ["device=cpu", *overrides])
        validate(cfg, output=None)
    assert cfg.lab.trace == "columns"  # the default preset's lab.* stay in the record, unread
