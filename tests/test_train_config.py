"""The training config's loading and derived settings: presets and YAML files, the device, the task's and the
correction's options (cases by hand, each one a slip in aisrl.train_config that other tests let pass)."""

import pytest
import torch

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
