"""benchmarks/engine.py: each part's section of BENCHMARKS.md says what machine its figures were measured on."""

from conftest import load_benchmark


def test_the_memory_section_names_the_machine_like_the_throughput_one(tmp_path, monkeypatch):
    eng = load_benchmark("engine")
    monkeypatch.setattr(eng, "ROOT", tmp_path)
    # the measurement itself (two fresh interpreters loading SmolLM2) is left out
    monkeypatch.setattr(eng, "memory", lambda: {"tokens": "x", "logprobs_peak_gb": 0.62, "naive_forward_peak_gb": 5.2})
    data = eng.main("memory")
    text = (tmp_path / "BENCHMARKS.md").read_text()
    section = text[text.index("<!-- BEGIN engine_memory -->") :]
    assert f"SmolLM2-135M FP32, {eng.machine_line(data['machine_memory'])}, 32 sequences" in section
    assert "| `logprobs(..., micro_batch=8, chunk=64)` | 0.62 |" in section
