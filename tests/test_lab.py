"""The lab: tokenizer round trip; the SFT warm start runs a fixed number of steps (or stops inside an optional
accuracy band), its held-out checks do not perturb training, and it is cached."""

import pytest
import torch

from aisrl.checkpoint import weights_digest
from aisrl.lab import CharTokenizer, LabConfig, completion_text, lab_model, run_sft
from aisrl.tasks import Problem


def test_char_tokenizer_round_trip_and_tags():
    tok = CharTokenizer()
    text = "<reasoning>12+7=19</reasoning><answer>19</answer>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) == 1 + 7 + 1 + 1 + 2 + 1  # tags are single tokens
    assert tok.decode([tok.bos_token_id, *tok.encode("3-1"), tok.eos_token_id, tok.pad_token_id]) == "3-1"
    with pytest.raises(ValueError, match="not in the lab tokenizer"):
        tok.encode("€")
    assert completion_text(Problem("2+2", "4", "2+2=4")) == "<reasoning>2+2=4</reasoning><answer>4</answer>"


class _FakeSFT:
    """Records what run_sft asks for; the accuracy after k steps is accs[k // 50]."""

    def __init__(self, accs):
        self.accs, self.steps, self.calls, self.checks = accs, 0, [], 0

    def train(self, n):
        self.calls.append(n)
        self.steps += n
        return torch.tensor(1.0)

    def accuracy(self):
        self.checks += 1
        return self.accs[min(self.steps // 50, len(self.accs) - 1)]


def test_run_sft_fixed_count_trains_every_step_and_scores_once_at_the_end():
    fake = _FakeSFT([0.0, 0.5, 0.5, 0.9])
    steps, acc = run_sft(LabConfig(sft_steps=120), fake.train, fake.accuracy, None)
    assert fake.calls == [50, 50, 20] and steps == 120  # a partial last chunk, nothing more
    assert fake.checks == 1 and acc == 0.5  # one held-out score, after step 120 (accs[2])
    fake = _FakeSFT([0.3])
    assert run_sft(LabConfig(sft_steps=0), fake.train, fake.accuracy, None) == (0, 0.3) and fake.calls == []


def test_run_sft_with_a_band_stops_at_the_first_check_inside_it_or_at_the_step_budget():
    fake = _FakeSFT([0.0, 0.05, 0.2, 0.5])
    assert run_sft(LabConfig(sft_steps=1000, target=(0.1, 0.4)), fake.train, fake.accuracy, None) == (100, 0.2)
    assert fake.checks == 3  # before training, after 50, after 100
    fake = _FakeSFT([0.2])  # already inside: no training at all
    assert run_sft(LabConfig(sft_steps=1000, target=(0.1, 0.4)), fake.train, fake.accuracy, None) == (0, 0.2)
    fake = _FakeSFT([0.0, 0.0, 0.0, 0.9])  # never inside within 130 steps: the budget ends it
    assert run_sft(LabConfig(sft_steps=130, target=(0.1, 0.4)), fake.train, fake.accuracy, None) == (130, 0.0)
    assert fake.calls == [50, 50, 30]
    for edge in (0.1, 0.4):  # the band is closed: an accuracy on either edge is inside
        assert run_sft(LabConfig(sft_steps=100, target=(0.1, 0.4)), fake.train, lambda e=edge: e, None) == (0, edge)


def test_band_checks_do_not_perturb_training(tmp_path, monkeypatch):
    """A band that is never reached checks accuracy every 50 steps; the weights must equal those of the fixed
    count, so a fixed `sft_steps` reproduces a band-stopped warm start of the same length exactly."""
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path))
    tiny = dict(hidden=32, layers=1, sft_examples=64, sft_steps=60)
    fixed, _, info = lab_model(LabConfig(**tiny), verbose=False)
    banded, _, banded_info = lab_model(LabConfig(**tiny, target=(2.0, 3.0)), verbose=False)
    assert info["sft_steps"] == banded_info["sft_steps"] == 60
    assert weights_digest(fixed.state_dict()) == weights_digest(banded.state_dict())
    untrained, _, _ = lab_model(LabConfig(**tiny | {"sft_steps": 0}), verbose=False)
    assert weights_digest(untrained.state_dict()) != weights_digest(fixed.state_dict())  # it did train


def test_the_warm_starts_accuracy_check_leaves_room_for_the_longest_answer(tmp_path, monkeypatch):
    # five-digit column traces run past 40 tokens: cut there, every right answer scored as wrong
    import aisrl.lab as lab

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path))
    room = []
    monkeypatch.setattr(lab, "greedy_accuracy", lambda model, tok, held, task, n: room.append(n) or 0.0)
    cfg = LabConfig(hidden=32, layers=1, sft_examples=64, sft_steps=0, max_operand=99999, trace="columns", ops="+")
    lab_model(cfg, verbose=False)
    task, tok = lab.lab_task(cfg), lab.CharTokenizer()
    held = task.problems("test", 80, seed=cfg.seed + 1)
    longest = max(len(tok.encode(lab.completion_text(p))) + 1 for p in held)  # with its EOS
    assert room[0] >= longest > 40
    lab_model(LabConfig(hidden=32, layers=1, sft_examples=64, sft_steps=0, seed=1), verbose=False)
    assert room[1] == 40  # the default lab's answers fit in 40: its warm start is unchanged


@pytest.mark.slow
def test_default_warm_start_trains_its_steps_leaves_room_for_rl_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path))
    cfg = LabConfig()  # the default lab (the main job's warm start): seed 0, 750 steps
    _, _, info = lab_model(cfg, verbose=False)
    assert info["sft_steps"] == cfg.sft_steps == 750
    assert 0.05 <= info["heldout_greedy_accuracy"] <= 0.6  # it learned something and left GRPO room
    assert 1e6 < info["params"] < 5e6
    again = lab_model(cfg, verbose=False)[2]  # second call: loaded from the cache, same numbers
    assert again == info | {"config": again["config"]}
    from aisrl.lab import _cache_dir

    (_cache_dir(cfg) / "model.safetensors").write_bytes(b"")  # emptied outside aisrl: named, with what to do
    with pytest.raises(RuntimeError, match=r"the cached warm start .* could not be loaded .*delete that folder"):
        lab_model(cfg, verbose=False)


def test_cache_entries_are_whole_when_builders_share_a_process_id(tmp_path):
    import threading
    import time

    from aisrl.lab import publish_cache

    cache = tmp_path / "lab" / "entry"

    def write(size):
        def files(tmp):
            (tmp / "info.json").write_text("{}")
            time.sleep(0.05)  # the other builder starts meanwhile (before: it deleted this one's folder)
            (tmp / "model.safetensors").write_bytes(b"w" * size)

        return files

    threads = [threading.Thread(target=publish_cache, args=(cache, write(n))) for n in (10, 20)]  # one pid
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in cache.iterdir()) == ["info.json", "model.safetensors"]
    assert [p.name for p in cache.parent.iterdir()] == ["entry"]  # no temporary folder left behind
    (cache / "info.json").unlink()  # a partial entry an earlier version left: replaced, not kept for ever
    publish_cache(cache, write(30))
    assert (cache / "model.safetensors").stat().st_size == 30
    with pytest.raises(OSError):  # a write that fails leaves nothing behind
        publish_cache(tmp_path / "lab" / "other", lambda tmp: (_ for _ in ()).throw(OSError("disk full")))
    assert [p.name for p in cache.parent.iterdir()] == ["entry"]


def test_a_cache_entry_that_cannot_be_published_is_named_and_leftovers_are_cleared(tmp_path, monkeypatch):
    import os
    import shutil

    from aisrl import lab
    from aisrl.lab import publish_cache

    def write(tmp):
        (tmp / "info.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"w")

    root = tmp_path / "lab"
    root.mkdir()
    (root / "abc").write_text("stray")  # before: taken for "another process published it first", nothing cached
    with pytest.warns(UserWarning, match=r"could not be cached at .*abc .*something else is in the way; delete it"):
        publish_cache(root / "abc", write)  # said, and the run goes on with the model it built
    assert (root / "abc").read_text() == "stray"
    # ... and said before the warm start is built, as an error the command line reports in one line
    from aisrl.lab import LabConfig, _cache_dir

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "c"))
    entry = _cache_dir(LabConfig())
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text("stray")
    with pytest.raises(FileExistsError, match="is in the way of the warm start's cache entry"):
        _cache_dir(LabConfig())
    # a killed builder's temporary copy is removed once a day old; a fresh one (a builder at work) is left alone
    for name, age in ((".e.tmpold", 2 * 86400), (".e.tmpnew", 60)):
        (root / name).mkdir()
        os.utime(root / name, (os.path.getmtime(root) - age,) * 2)
    publish_cache(root / "e", write)
    assert sorted(p.name for p in root.iterdir()) == [".e.tmpnew", "abc", "e"]
    # a complete entry published between the check for a partial one and its removal is kept (before: deleted)
    shutil.rmtree(root / "e")
    (root / "e").mkdir()  # partial: no info.json
    real_aside = lab._move_aside

    def aside(cache):  # another builder replaces the partial entry with a complete one, just before the removal
        write(cache)
        (cache / "model.safetensors").write_bytes(b"theirs")
        real_aside(cache)

    monkeypatch.setattr(lab, "_move_aside", aside)
    publish_cache(root / "e", write)
    assert (root / "e" / "model.safetensors").read_bytes() == b"theirs"
    assert sorted(p.name for p in root.iterdir()) == [".e.tmpnew", "abc", "e"]


def test_columns_lab_preset_has_a_large_disjoint_held_out_set_and_room_for_every_trace():
    from aisrl.build import problem_sets
    from aisrl.lab import lab_task
    from aisrl.train_config import load_config

    cfg = load_config("lab_columns", ["device=cpu"])
    task = lab_task(cfg.lab)
    pool, held = problem_sets(cfg, task)
    assert len(pool) == cfg.train_problems and len(held) == cfg.eval_problems == 500
    assert not {p.question for p in pool} & {p.question for p in held}
    tok = CharTokenizer()
    longest = max(len(tok.encode(completion_text(p))) + 1 for p in pool + held)  # + EOS
    assert longest == 1 + 15 + 1 + 1 + 3 + 1 + 1  # 99+99: two columns, a three-digit answer
    assert longest <= cfg.rollout.max_new_tokens  # no correct completion is cut off


def test_a_band_stopped_warm_start_is_keyed_by_the_tasks_scorer(monkeypatch, tmp_path):
    # with lab.target the scorer decides where the warm start stops: an entry of the old scorer was reused silently
    from aisrl.lab import LabConfig, _cache_dir
    from aisrl.tasks import TASKS

    monkeypatch.setenv("AISRL_CACHE", str(tmp_path))
    countdown = TASKS["countdown"]
    banded, plain = LabConfig(task="countdown", target=(0.3, 0.5)), LabConfig(task="countdown")
    keys = (_cache_dir(banded), _cache_dir(plain))
    monkeypatch.setattr(countdown, "scorer_version", countdown.scorer_version + 1)
    assert _cache_dir(banded) != keys[0]  # a new scorer, a new band-stopped warm start
    assert _cache_dir(plain) == keys[1]  # a fixed number of steps trains the same weights whatever the scorer
    # other problems train other weights: a task's new problems_version is a new entry, banded or not
    monkeypatch.setattr(countdown, "problems_version", getattr(countdown, "problems_version", 1) + 1)
    assert _cache_dir(plain) != keys[1]
