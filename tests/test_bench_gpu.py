"""benchmarks/gpu_grpo.py and gpu_rollout.py: a subcommand is named by the first argument alone, a bad setting is
refused before anything runs, and a run that fails keeps the published results (its progress goes to OUT.partial)."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from conftest import load_benchmark


def test_rollout_options_reach_the_run_and_a_misspelt_subcommand_runs_nothing(monkeypatch):
    gr = load_benchmark("gpu_rollout")
    calls = []
    monkeypatch.setattr(gr, "run", lambda *a: calls.append(("run", a)))
    monkeypatch.setattr(gr, "publish", lambda out, section: calls.append(("publish", out, section)))
    gr.main(["shapes=qwen3-1.7b", "batches=8"])  # before: 'shapes=qwen3-1.7b' was taken as the subcommand, dropped
    [(what, args)] = calls
    assert what == "run" and args[0] == ["qwen3-1.7b"] and args[1] == [8]
    with pytest.raises(SystemExit, match=r"unknown command 'pubish'; choose from \['run', 'publish'\]"):
        gr.main(["pubish"])  # before: a full run, replacing the published results
    gr.main(["publish", "out=o.json"])
    gr.main(["publish", "out=h.json", "section=recheck"])
    assert calls[1:] == [("publish", "o.json", "gpu_rollout"), ("publish", "h.json", "recheck")]
    calls.clear()
    gr.main(["hf=true", "profile=No", "gemm=0"])  # before: anything but "1" was off, "hf=true" included
    hf, profile, _, gemm, accuracy = calls[0][1][4:9]
    assert (hf, profile, gemm, accuracy) == (True, False, False, True)
    with pytest.raises(SystemExit, match=r"hf='on': give 1/true/yes or 0/false/no"):
        gr.main(["hf=on"])


def test_rollout_publish_writes_a_throughput_only_run_into_its_own_section(tmp_path, monkeypatch):
    gr = load_benchmark("gpu_rollout")
    written = {}
    monkeypatch.setattr(gr, "update_section", lambda path, name, text: written.update({name: text}))
    row = dict(shape="qwen3-8b", batch=64, seconds=4.0, prefill_s=0.5, floor_step_ms=3.0)
    data = {"machine": {"cuda": "GPU X", "torch": "2.11"}, "triton": "3.6", "command": "python gpu_rollout.py run",
            "prompt": 256, "new_tokens": 512, "copy_bandwidth_TBs": 4.19, "accuracy": [], "profile": [],
            "throughput": [{**row, "variant": "bf16", "tok_s": 8000.0, "decode_step_ms": 7.0},
                           {**row, "variant": "fp8_w8a8", "tok_s": 10000.0, "decode_step_ms": 5.6}]}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(data))
    gr.publish(tmp_path / "r.json", "gpu_rollout_recheck")
    text = written["gpu_rollout_recheck"]
    assert "| qwen3-8b | 64 | fp8_w8a8 | 10000 | 4.0 | 5.60 | 3.00 | 1.25x |  |" in text  # 10000 / 8000
    assert "GPU X" in text and "4.19 TB/s" in text and "Accuracy" not in text  # no accuracy rows: no empty table


def _fake_variant_runs(gg, monkeypatch, failing: str):
    """gpu_grpo's per-variant child process: writes a metrics file, or fails for the variant `failing`."""
    started = []

    def fake(cmd, check):
        kw = dict(a.split("=", 1) for a in cmd[3:])
        started.append(kw["variant"])
        if kw["variant"] == failing:
            raise subprocess.CalledProcessError(1, cmd)
        row = {k: 1.0 for k in ("time_rollout", "time_logprob", "time_correction", "time_train", "time_sync",
                                "num_tokens", "alpha", "k3_kl")}  # fmt: skip
        out = Path(kw["dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")

    monkeypatch.setattr(gg, "subprocess", types.SimpleNamespace(run=fake))
    return started


def test_grpo_checks_every_variant_first_and_replaces_the_results_only_once_all_have_run(tmp_path, monkeypatch):
    gg = load_benchmark("gpu_grpo")
    out = tmp_path / "gpu_grpo.json"
    out.write_text('{"published": true}')
    started = _fake_variant_runs(gg, monkeypatch, failing="fp8_e4m3_w8a8_kv")
    with pytest.raises(ValueError, match="variant 'fp8_e4m3_w8a8_kvv': rollout.quant"):
        gg.run("tiny", 2, 4, ["none", "fp8_e4m3_w8a8_kvv"], str(out), device="cpu")
    assert started == []  # refused before the first variant ran
    with pytest.raises(subprocess.CalledProcessError):
        gg.run("tiny", 2, 4, ["none", "fp8_e4m3_w8a8_kv"], str(out), device="cpu")
    assert json.loads(out.read_text()) == {"published": True}
    assert list(json.loads((tmp_path / "gpu_grpo.json.partial").read_text())["runs"]) == ["none"]
    data = gg.run("tiny", 2, 4, ["none"], str(out), device="cpu")
    assert json.loads(out.read_text()) == data and list(data["runs"]) == ["none"]
    assert not (tmp_path / "gpu_grpo.json.partial").exists()
    # the runs are scratch: nothing beside the results (before: their checkpoints, ~20 GB for qwen3-1.7b, stayed
    # in benchmarks/results/)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_grpo.json"] and data["vocab"] == 512
    # published without a BF16 run: no ratio to it, rather than a TypeError
    data = gg.run("tiny", 2, 4, ["fp8_e4m3_w8a8"], str(out), device="cpu")
    written = {}
    monkeypatch.setattr(gg, "update_section", lambda path, name, text: written.setdefault(name, text))
    gg.publish(str(out))
    assert "(vocabulary 512)" in written["gpu_grpo"] and "| - |" in written["gpu_grpo"]


def test_rollout_run_that_fails_keeps_the_published_results(tmp_path, monkeypatch):
    gr = load_benchmark("gpu_rollout")
    out = tmp_path / "gpu_rollout.json"
    out.write_text('{"sources": "merged by hand"}')
    with pytest.raises(ValueError, match=r"unknown shapes \['qwen3-7b'\]"):
        gr.run(["qwen3-7b"], [8], 16, 8, False, False, str(out), gemms=False, acc=False)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="0"))
    monkeypatch.setattr(gr, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(gr, "_model", lambda shape: shape)

    def throughput(model, shape, batches, prompt, new, hf, bw, log):  # logs each row, as the real one does
        log({"shape": shape})
        if shape == "qwen3-1.7b":
            raise RuntimeError("CUDA out of memory")
        return [{"shape": shape}]

    monkeypatch.setattr(gr, "throughput", throughput)
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        gr.run(["qwen3-8b", "qwen3-1.7b"], [8], 16, 8, False, False, str(out), gemms=False, acc=False)
    assert json.loads(out.read_text()) == {"sources": "merged by hand"}
    assert json.loads((tmp_path / "gpu_rollout.json.partial").read_text())["throughput"] == [{"shape": "qwen3-8b"}]
    gr.run(["qwen3-8b"], [8], 16, 8, False, False, str(out), gemms=False, acc=False)
    assert json.loads(out.read_text())["throughput"] == [{"shape": "qwen3-8b"}]
