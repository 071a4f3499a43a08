"""Digests of initial weights (start.json): what makes two runs of one seed a pair; the recorded config."""

import json

import pytest
import torch

from aisrl.checkpoint import (
    config_changes,
    load_checkpoint,
    read_jsonl,
    record_config,
    record_start,
    run_start,
    same_start,
    save_checkpoint,
    weights_digest,
)


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


def test_start_is_recorded_until_the_first_checkpoint_and_runs_without_one_pair_with_anything(tmp_path):
    model = torch.nn.Linear(3, 2)
    a, b, old = tmp_path / "a", tmp_path / "b", tmp_path / "old"
    for d in (a, b, old):
        d.mkdir()
    record_start(a, model)
    assert run_start(a) == weights_digest(model.state_dict())
    assert "cpu_capability" in json.loads((a / "start.json").read_text())["machine"]
    with torch.no_grad():
        model.weight.add_(1.0)
    first = run_start(a)
    record_start(a, model)  # a start that reached no checkpoint is replaced by the next one, with other weights
    assert run_start(a) == weights_digest(model.state_dict()) != first
    (a / "checkpoints").mkdir()
    (a / "checkpoints" / "latest").write_text("step_000020")  # from here on the record is the run's
    with torch.no_grad():
        model.weight.add_(1.0)
    record_start(a, model)
    record_start(b, model)
    assert run_start(a) != run_start(b) and not same_start(a, b)
    assert run_start(old) is None and same_start(a, old) and same_start(old, b)


def test_a_resume_records_the_new_length_and_keeps_every_other_key(tmp_path):
    first = {"max_steps": 100, "eval_every": 20, "lr": 5e-4, "lab": {"target": [0.4, 0.9]}}
    record_config(tmp_path, {**first, "lr": 1.0})
    record_config(tmp_path, first)  # no checkpoint yet (the first start failed): nothing to continue, a new record
    assert json.loads((tmp_path / "config.json").read_text())["lr"] == 5e-4
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000020")  # from here on the record is the run's
    record_config(tmp_path, {**first, "max_steps": 300}, write=False)  # a rank that may not write changes nothing
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 100
    # a later version without lab.target: the key only the record has is kept, the resumable one moves
    record_config(tmp_path, {"max_steps": 300, "eval_every": 20, "lr": 5e-4, "new_field": 1})
    assert json.loads((tmp_path / "config.json").read_text()) == {**first, "max_steps": 300}
    with pytest.raises(ValueError, match=r"another config \(lr: 0.0005 -> 0.001\)"):
        record_config(tmp_path, {**first, "max_steps": 400, "lr": 1e-3})
    assert json.loads((tmp_path / "config.json").read_text())["max_steps"] == 300  # a refused start writes nothing
    # a field the record predates: at its default it keeps the old behaviour; set away from it, it is a change
    defaults = {"max_steps": 100, "eval_every": 20, "lr": 5e-4, "new_field": 1, "veto": 0.0}
    record_config(tmp_path, {**first, "max_steps": 300, "veto": 0.0}, defaults=defaults)
    with pytest.raises(ValueError, match=r"veto: not recorded \(the default 0.0\) -> 0.05"):
        record_config(tmp_path, {**first, "max_steps": 300, "veto": 0.05}, defaults=defaults)
    # a tuple and the list JSON keeps of it are one value, on either side (aisrl eval compares two dataclasses)
    assert config_changes({"lab": {"target": (0.4, 0.9)}}, {"lab": {"target": [0.4, 0.9]}}) == []
    assert config_changes({"lab": {"target": [0.4, 0.9]}}, {"lab": {"target": (0.4, 0.9)}}) == []
    # a record cut by a hand edit is named, with what to do (before: the bare JSONDecodeError)
    (tmp_path / "config.json").write_text('{"seed": 0, ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON .*; restore it from a copy, or delete it"):
        record_config(tmp_path, first)


def test_metrics_file_with_a_cut_last_line_reads_without_it(tmp_path):
    f = tmp_path / "metrics.jsonl"
    assert read_jsonl(f) == []  # no file yet
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    assert read_jsonl(f) == [{"step": 1}, {"step": 2}]
    f.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        read_jsonl(f)


def test_mapping_fields_change_as_a_whole_and_sections_key_by_key():
    from aisrl.checkpoint import config_changes

    old = {"lr": 1e-3, "task_options": {"max_operand": 20}, "correction": {"name": "icepop", "options": {"low": 0.5}}}
    same = json.loads(json.dumps(old))
    assert config_changes(old, same) == []
    added = {**same, "task_options": {"max_operand": 20, "ops": "+-*"}}  # an entry added is a change
    assert config_changes(old, added) == ["task_options: {'max_operand': 20} -> {'max_operand': 20, 'ops': '+-*'}"]
    cleared = {**same, "correction": {"name": "icepop", "options": {}}}  # so is one removed
    assert config_changes(old, cleared) == ["correction.options: {'low': 0.5} -> {}"]
    older = {"lr": 1e-3, "correction": {"name": "icepop"}}  # recorded before the fields existed: not a change
    assert config_changes(older, same) == []


def test_atomic_write_leaves_no_temporary_file_and_keeps_the_mode(tmp_path):
    import stat

    from aisrl.checkpoint import atomic_write_text

    f = tmp_path / "summary.json"
    atomic_write_text(f, "one")
    assert f.read_text() == "one" and stat.S_IMODE(f.stat().st_mode) == 0o644
    f.chmod(0o600)
    atomic_write_text(f, "two")
    assert f.read_text() == "two" and stat.S_IMODE(f.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    atomic_write_text(f, "Δ → ±")  # BENCHMARKS.md holds such characters: UTF-8 whatever the locale's encoding
    assert f.read_bytes() == "Δ → ±".encode()


def test_pruning_keeps_this_runs_previous_checkpoint_and_drops_an_abandoned_starts(tmp_path):
    from aisrl.checkpoint import latest_checkpoint, latest_step, save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in (10, 20):  # a first start, then `latest` deleted to start over
        save_checkpoint(tmp_path, step, model, opt, {})
    (tmp_path / "checkpoints" / "latest").unlink()
    names = lambda: sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))  # noqa: E731
    save_checkpoint(tmp_path, 5, model, opt, {})
    assert names() == ["step_000005"] and latest_step(tmp_path) == 5
    save_checkpoint(tmp_path, 15, model, opt, {})
    assert names() == ["step_000005", "step_000015"]  # keep=2: this one and the one before
    save_checkpoint(tmp_path, 25, model, opt, {})
    assert names() == ["step_000015", "step_000025"] and latest_checkpoint(tmp_path).name == "step_000025"
    save_checkpoint(tmp_path, 30, model, opt, {}, keep=1)
    assert names() == ["step_000030"]
    # past step 999999 the names grow a digit: the checkpoint kept before the new one is the one of the step before
    for step in (999_999, 1_000_000, 1_000_001):
        save_checkpoint(tmp_path, step, model, opt, {}, keep=2)
    assert names() == ["step_1000000", "step_1000001"]  # before: step_999999 kept, as the later name in text order
    # keep=0 keeps every checkpoint of this run (to branch from any step later); an abandoned start's still goes
    for step in (1_000_002, 1_000_003):
        save_checkpoint(tmp_path, step, model, opt, {}, keep=0)
    assert names() == ["step_1000000", "step_1000001", "step_1000002", "step_1000003"]
    save_checkpoint(tmp_path, 1_000_002, model, opt, {}, keep=0)  # `latest` moved back to 1000002
    assert names() == ["step_1000000", "step_1000001", "step_1000002"]


def test_a_save_cut_short_at_another_step_leaves_nothing_behind(tmp_path, monkeypatch):
    """A save that dies mid-write leaves `.tmp_step_N` (a model's size); the next save clears it even when step N is
    never saved again (before: only a save of the same step did, found by review)."""
    from aisrl.checkpoint import latest_step, save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 2, model, opt, {})
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, 4, model, opt, {})
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert (root / ".tmp_step_000004").is_dir() and latest_step(tmp_path) == 2  # the pointer never moved
    save_checkpoint(tmp_path, 3, model, opt, {})  # a resume from step 2 that checkpoints at other steps
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_a_run_keeps_the_checkpoints_it_is_told_to(tmp_path, monkeypatch):
    from conftest import TINY_LAB

    from aisrl.train_checks import validate
    from aisrl.train_config import load_config
    from aisrl.trainer import train

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    base = [*TINY_LAB, "max_steps=4", "checkpoint_every=1"]
    for keep, kept in ((0, [1, 2, 3, 4]), (3, [2, 3, 4])):
        out = tmp_path / f"keep{keep}"
        train(load_config("lab", [*base, f"keep_checkpoints={keep}", f"output_dir={out}"]), log=lambda _: None)
        assert sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*")) == kept
    out = tmp_path / "every2"  # every second step, and the last
    train(load_config("lab", [*base, "max_steps=5", "checkpoint_every=2", "keep_checkpoints=0", f"output_dir={out}"]),
          log=lambda _: None)  # fmt: skip
    assert sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*")) == [2, 4, 5]
    # a resume that leaves it out would prune what the run kept: refused, naming it
    with pytest.raises(ValueError, match=r"another config \(keep_checkpoints: 0 -> 2\)") as refused:
        train(load_config("lab", [*base, "max_steps=5", f"output_dir={tmp_path / 'keep0'}"]), log=lambda _: None)
    assert f"`aisrl train {tmp_path / 'keep0' / 'config.json'}` reads them from the record" in str(refused.value)
    assert len(list((tmp_path / "keep0" / "checkpoints").glob("step_*"))) == 4
    with pytest.raises(ValueError, match="keep_checkpoints is how many .* >= 0 .* got -1"):
        validate(load_config("lab", ["keep_checkpoints=-1"]))


def test_a_checkpoint_of_another_model_is_refused_with_the_settings_to_check(tmp_path):
    model = torch.nn.Linear(3, 2)
    ckpt = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()), {})
    wider = torch.nn.Linear(4, 2)  # a run resumed under another lab.hidden, say
    with pytest.raises(ValueError, match=r"step_000001 holds weights of another model .*size mismatch for weight.*"
                                         r"model\.\*, lora\.\* or lab\.\* settings differ"):  # fmt: skip
        load_checkpoint(ckpt, wider, torch.optim.AdamW(wider.parameters()))


@pytest.mark.parametrize("damaged", ["model.safetensors", "state.pt"])
def test_a_damaged_checkpoint_file_is_named_with_what_to_do(tmp_path, damaged):
    model = torch.nn.Linear(3, 2)
    ckpt = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()), {})
    path = ckpt / damaged
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a partial copy
    with pytest.raises(ValueError) as e:
        load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
    assert str(e.value).startswith(f"{path} cannot be read (")
    advice = "damaged or cut short. Restore it from a copy, or resume from an earlier checkpoint by writing its folder"
    assert f"{advice} name (step_NNNNNN) into {tmp_path / 'checkpoints' / 'latest'}" in str(e.value)


def test_a_flipped_byte_in_state_pt_is_named_like_a_cut_one(tmp_path):
    # some flips make torch.load raise a ValueError (text that is not UTF-8, an unknown byte order): it escaped the
    # named error without its path or what to do
    model = torch.nn.Linear(3, 2)
    ckpt = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()), {})
    path = ckpt / "state.pt"
    orig = path.read_bytes()
    failures = 0
    for i in range(0, len(orig), max(1, len(orig) // 200)):
        flipped = bytearray(orig)
        flipped[i] ^= 0xFF
        path.write_bytes(bytes(flipped))
        try:
            load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
        except ValueError as e:
            assert str(e).startswith(f"{path} cannot be read ("), (i, str(e)[:120])
            failures += 1
    assert failures > 0


def test_records_that_parse_but_are_not_records_are_named(tmp_path):
    from aisrl.checkpoint import read_record

    for text in ("null", "[]", "3"):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=r"config.json holds \w+, not a record"):
            read_record(tmp_path / "config.json")
    (tmp_path / "start.json").write_text("{}")  # before: KeyError 'weights'
    with pytest.raises(ValueError, match="start.json records no digest of the initial weights"):
        run_start(tmp_path)
    # a metrics file whose cut-short last line holds bytes that are not UTF-8 reads without it (before:
    # UnicodeDecodeError); such bytes inside the file name the line
    f = tmp_path / "metrics.jsonl"
    f.write_bytes(b'{"step": 1}\n{"step": 2, "note": "\xc3')
    assert read_jsonl(f) == [{"step": 1}]
    f.write_bytes(b'{"step": 1}\n{"st\xff\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl line 2 is not JSON"):
        read_jsonl(f)


def test_a_dataset_is_the_same_under_two_spellings_of_its_path_and_a_moved_copy_is_told_by_its_rows(
        tmp_path, monkeypatch):  # fmt: skip
    from aisrl.checkpoint import config_changes, record_start, same_dataset

    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    assert config_changes({"dataset": "d.jsonl"}, {"dataset": str(tmp_path / "d.jsonl")}) == []
    assert config_changes({"dataset": "d.jsonl"}, {"dataset": "e.jsonl"}) == ["dataset: 'd.jsonl' -> 'e.jsonl'"]
    assert config_changes({"dataset": ""}, {"dataset": "x"}) == ["dataset: '' -> 'x'"]

    run = tmp_path / "run"
    run.mkdir()
    assert same_dataset(run, "d.jsonl") is False  # no start.json: nothing recorded to check against
    record_start(run, torch.nn.Linear(2, 2))
    assert same_dataset(run, "d.jsonl") is False  # a run that reads no file records none
    record_start(run, torch.nn.Linear(2, 2), "d.jsonl")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "copy.jsonl").write_bytes((tmp_path / "d.jsonl").read_bytes())
    assert same_dataset(run, "sub/copy.jsonl") is True
    with pytest.raises(ValueError, match=r"dataset='gone.jsonl' does not exist, and .* was started on"):
        same_dataset(run, "gone.jsonl")
    (tmp_path / "d.jsonl").write_text('{"question": "1+1?", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"holds other rows"):
        same_dataset(run, "d.jsonl")
