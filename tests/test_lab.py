"""The lab: tokenizer round trip, the SFT warm start lands in its target band, and is cached."""

import pytest

from aisrl.lab import CharTokenizer, LabConfig, completion_text, lab_model
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


@pytest.mark.slow
def test_sft_warm_start_reaches_its_band_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path))
    cfg = LabConfig()  # the default lab: seed 0
    _, _, info = lab_model(cfg, verbose=False)
    lo, hi = cfg.target
    assert lo <= info["heldout_greedy_accuracy"] <= hi and info["sft_steps"] < cfg.sft_max_steps
    assert 1e6 < info["params"] < 5e6
    again = lab_model(cfg, verbose=False)[2]  # second call: loaded from the cache, same numbers
    assert again == info | {"config": again["config"]}


def test_columns_lab_preset_has_a_large_disjoint_held_out_set_and_room_for_every_trace():
    from aisrl.lab import lab_task
    from aisrl.train_config import load_config
    from aisrl.trainer import problem_sets

    cfg = load_config("lab_columns", ["device=cpu"])
    task = lab_task(cfg.lab)
    pool, held = problem_sets(cfg, task)
    assert len(pool) == cfg.train_problems and len(held) == cfg.eval_problems == 500
    assert not {p.question for p in pool} & {p.question for p in held}
    tok = CharTokenizer()
    longest = max(len(tok.encode(completion_text(p))) + 1 for p in pool + held)  # + EOS
    assert longest == 1 + 15 + 1 + 1 + 3 + 1 + 1  # 99+99: two columns, a three-digit answer
    assert longest <= cfg.rollout.max_new_tokens  # no correct completion is cut off
