"""Digests of initial weights (start.json): what makes two runs of one seed a pair."""

import json

import torch

from aisrl.checkpoint import record_start, run_start, same_start, weights_digest


def test_weights_digest_sees_every_value_name_and_dtype_but_not_dict_order():
    a = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(0.5), "h": torch.ones(2, dtype=torch.bfloat16)}
    d = weights_digest(a)
    assert len(d) == 16 and d == weights_digest(dict(reversed(list(a.items()))))
    nudged = {**a, "w": a["w"].clone()}
    nudged["w"][1, 2] = torch.nextafter(nudged["w"][1, 2], torch.tensor(10.0))  # one ulp
    assert weights_digest(nudged) != d
    assert weights_digest({**a, "w": a["w"].reshape(3, 2)}) != d  # same bytes, other shape
    assert weights_digest({**a, "h": a["h"].float()}) != d
    assert weights_digest({"v" if k == "w" else k: v for k, v in a.items()}) != d


def test_start_is_recorded_once_and_runs_without_one_pair_with_anything(tmp_path):
    model = torch.nn.Linear(3, 2)
    a, b, old = tmp_path / "a", tmp_path / "b", tmp_path / "old"
    for d in (a, b, old):
        d.mkdir()
    record_start(a, model)
    assert run_start(a) == weights_digest(model.state_dict())
    assert "cpu_capability" in json.loads((a / "start.json").read_text())["machine"]
    with torch.no_grad():
        model.weight.add_(1.0)
    record_start(a, model)  # a resume: the first record stays
    record_start(b, model)
    assert run_start(a) != run_start(b) and not same_start(a, b)
    assert run_start(old) is None and same_start(a, old) and same_start(old, b)
