"""Rollout engine benchmarks on SmolLM2-135M (issue 3): throughput vs Hugging Face `generate`, peak memory
of `logprobs` vs a naive full forward. Writes benchmarks/results/engine.json and BENCHMARKS.md sections.

    python benchmarks/engine.py throughput [batches=1,8,32,64] [new_tokens=128]
    python benchmarks/engine.py memory
    python benchmarks/engine.py profile      # share of decode time per op at batch 64
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from aisrl.bench.report import machine, update_section, write_json
from aisrl.models import load_model
from aisrl.rollout import SamplingParams, generate

ROOT = Path(__file__).resolve().parent.parent


def _prompts(tok, n):
    qs = [f"Compute {i + 3} times {2 * i + 5}, then explain your method in detail." for i in range(n)]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in qs]


def throughput(batches=(1, 8, 32, 64), new_tokens=128):
    model, tok = load_model("smollm2")
    rows = []
    for b in batches:
        prompts = [list(p if isinstance(p[0], int) else p["input_ids"]) for p in _prompts(tok, b)]
        params = SamplingParams(max_new_tokens=new_tokens)
        t0 = time.perf_counter()
        r = generate(model, prompts, params, seeds=list(range(b)), eos_id=[])  # no EOS: exactly new_tokens each
        ours = time.perf_counter() - t0
        assert int(r.completion_mask.sum()) == b * new_tokens
        tok.padding_side = "left"
        enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tok.pad_token_id)  # fmt: skip
        hf = time.perf_counter() - t0
        assert out.shape[1] - enc["input_ids"].shape[1] == new_tokens
        rows.append({"batch": b, "new_tokens": new_tokens, "ours_tok_s": b * new_tokens / ours,
                     "hf_tok_s": b * new_tokens / hf, "speedup": hf / ours})  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def profile(batch=64, steps=24):
    """Share of CPU time per aten op over `steps` decode steps at `batch` (what bounds the engine)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, tok = load_model("smollm2")
    prompts = [list(p if isinstance(p[0], int) else p["input_ids"]) for p in _prompts(tok, batch)]
    generate(model, prompts, SamplingParams(max_new_tokens=4), eos_id=[])  # warm-up
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, prompts, SamplingParams(max_new_tokens=steps), eos_id=[])
    ops = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ops)
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:8]
    return {e.key: round(100 * e.self_cpu_time_total / total, 1) for e in top}


def _peak_rss_gb_of(code: str) -> float:
    """Run `code` in a fresh interpreter after loading SmolLM2; return its peak RSS increase (GB)."""
    script = f"""
import torch, json
from aisrl.models import load_model
from aisrl.rollout import logprobs
model, tok = load_model("smollm2")
g = torch.Generator().manual_seed(0)
P, T, B = 32, 256, 32
prompt = torch.randint(100, 40000, (B, P), generator=g); pmask = torch.ones(B, P, dtype=torch.bool)
comp = torch.randint(100, 40000, (B, T), generator=g); cmask = torch.ones(B, T, dtype=torch.bool)
def rss(key):
    return int([l for l in open("/proc/self/status") if l.startswith(key)][0].split()[1]) / 2**20
open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS high-water mark
base = rss("VmRSS")
with torch.no_grad():
{code}
print(json.dumps({{"peak_gb": rss("VmHWM") - base}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_gb"]


def memory():
    ours = _peak_rss_gb_of("    lp = logprobs(model, prompt, pmask, comp, cmask, micro_batch=8, chunk=64)")
    naive = _peak_rss_gb_of(
        "    ids = torch.cat([prompt, comp], 1)\n"
        "    lp = model(ids).logits[:, P - 1 : -1].log_softmax(-1).gather(-1, comp[..., None])"
    )
    return {"tokens": "32 x (32 prompt + 256 completion)", "logprobs_peak_gb": ours, "naive_forward_peak_gb": naive}


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "throughput"
    path = ROOT / "benchmarks/results/engine.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["machine"] = machine()
    if what == "throughput":
        rows = throughput()
        data["throughput"] = rows
        body = ("Command: `python benchmarks/engine.py throughput`; SmolLM2-135M FP32, 2 CPUs, 128 new tokens per "
                "request (EOS ignored), plain sampling (T=1), both engines in the same run.\n\n"
                "| batch | aisrl tok/s | HF generate tok/s | speedup |\n|---|---|---|---|\n")  # fmt: skip
        body += "\n".join(f"| {r['batch']} | {r['ours_tok_s']:.0f} | {r['hf_tok_s']:.0f} | {r['speedup']:.2f}x |"
                          for r in rows) + "\n"  # fmt: skip
        update_section(ROOT / "BENCHMARKS.md", "engine_throughput", body)
    elif what == "profile":
        data["profile_batch64_percent"] = profile()
        print(data["profile_batch64_percent"])
    else:
        m = memory()
        data["memory"] = m
        print(m)
        body = ("Command: `python benchmarks/engine.py memory`; SmolLM2-135M FP32, 32 sequences x (32 prompt + 256 "
                "completion) tokens, peak RSS above the loaded model (VmHWM after a reset).\n\n"
                "| method | peak GB |\n|---|---|\n"
                f"| `logprobs(..., micro_batch=8, chunk=64)` | {m['logprobs_peak_gb']:.2f} |\n"
                f"| naive: one forward + full-vocab log_softmax | {m['naive_forward_peak_gb']:.2f} |\n")  # fmt: skip
        update_section(ROOT / "BENCHMARKS.md", "engine_memory", body)
    write_json(path, data)
