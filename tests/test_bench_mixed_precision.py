"""benchmarks/mixed_precision.py: the kept sets follow each format's ranking, keep what they say, and are measured on
their own samples (a set keeping every layer of a block but one is a different copy than the whole format)."""

import pytest
from conftest import load_benchmark


def test_kept_sets_are_the_top_of_the_ranking_and_report_their_share(tmp_path, monkeypatch):
    monkeypatch.setenv("AISRL_CACHE", str(tmp_path / "cache"))
    mp = load_benchmark("mixed_precision")
    (tmp_path / "tiny.yaml").write_text("model: {name: lab}\nlab: {hidden: 32, layers: 2, sft_steps: 0}\n"
                                        "rollout: {max_new_tokens: 8}\n")  # fmt: skip
    cfg = mp.MixedConfig(preset=str(tmp_path / "tiny.yaml"), formats=["mxfp4_w4a4"], prompts=6, tops=[1, 3, 99])
    res = mp.study(cfg)["mxfp4_w4a4"]
    ranking = [x["layer"] for x in res["ranking"]]
    assert len(ranking) == 14  # 2 blocks x (q, k, v, o, gate, up, down); the output head is not quantised
    kept = [s["keep"] for s in res["sets"]]
    assert kept == [[], ranking[:1], ranking[:3], ranking[:13]]  # 99 is capped: one layer must stay quantised
    shares = [s["kept_weights"] for s in res["sets"]]
    assert shares[0] == 0 and shares == sorted(shares) and shares[-1] < 1
    assert res["sets"][-1]["k3_kl"] < res["sets"][0]["k3_kl"]  # 13 of 14 layers in full precision: far closer
    assert "| mxfp4_w4a4 | 3 |" in mp.table({"mxfp4_w4a4": res})
    with pytest.raises(ValueError, match="a training preset .*, a model .* or a run's checkpoint .*: one, not several"):
        mp.study(mp.MixedConfig(model="tiny-llama"))  # the default preset and a model
    with pytest.raises(ValueError, match="one, not several or none"):
        mp.study(mp.MixedConfig(preset=""))
    run = "runs/s/nvfp4_w4a4/ais/seed42:100"
    name = mp.subject(mp.MixedConfig(preset="", start=run, formats=["nvfp4_w4a4"], tops=[1, 2, 4]))
    assert name == "s_nvfp4_w4a4_ais_seed42_step100"  # the study folder, format, method, seed and step


def test_runs_with_other_settings_never_take_a_published_name():
    """A smoke run (fewer prompts, one top) or another seed wrote over the published table of its preset."""
    mp = load_benchmark("mixed_precision")
    assert mp.subject(mp.MixedConfig()) == "lab_columns"  # BENCHMARKS.md's sections keep their names
    smollm2 = mp.MixedConfig(preset="", model="smollm2", prompts=16, formats=["fp8_e4m3_w8a8"], tops=[1, 2, 4, 8, 16])
    assert mp.subject(smollm2) == "smollm2"
    smoke, other_seed = mp.subject(mp.MixedConfig(prompts=8, tops=[1])), mp.subject(mp.MixedConfig(seed=3))
    assert smoke.startswith("lab_columns_") and other_seed.startswith("lab_columns_") and smoke != other_seed
    assert mp.subject(mp.MixedConfig(preset="", model="smollm2")) != "smollm2"
