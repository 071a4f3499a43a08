"""Rollout engine benchmarks on SmolLM2-135M (issue 3): throughput vs Hugging Face `generate`, peak memory
of `logprobs` vs a naive full forward. Writes benchmarks/results/engine.json and BENCHMARKS.md sections.

    python benchmarks/engine.py throughput   # batches 1, 8, 32, 64 x 128 new tokens
    python benchmarks/engine.py memory
    python benchmarks/engine.py profile      # share of the static engine's decode time per op at batch 64
"""

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from aisrl.bench.report import machine, machine_line, update_section, write_json
from aisrl.engine import Engine
from aisrl.models import load_model, prompt_ids
from aisrl.rollout import SamplingParams, generate

ROOT = Path(__file__).resolve().parent.parent


def _prompts(tok, n):
    qs = [f"Compute {i + 3} times {2 * i + 5}, then explain your method in detail." for i in range(n)]
    return [prompt_ids(tok, q) for q in qs]


def _runners(model, tok, engine, prompts):
    """{name: run(n)} generating n new tokens per prompt (no EOS) with each engine."""
    b = len(prompts)
    enc = tok.pad({"input_ids": prompts}, return_tensors="pt")

    def hf(n):
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, max_new_tokens=n, min_new_tokens=n, top_k=0, top_p=1.0,
                                 temperature=1.0, pad_token_id=tok.pad_token_id)  # fmt: skip
        assert out.shape[1] - enc["input_ids"].shape[1] == n

    def ours(gen):
        def run(n):
            r = gen(prompts, SamplingParams(max_new_tokens=n), seeds=list(range(b)), eos_id=[])
            assert int(r.completion_mask.sum()) == b * n

        return run

    return {"engine": ours(engine.generate), "generate": ours(functools.partial(generate, model)), "hf": hf}


def throughput(batches=(1, 8, 32, 64), new_tokens=128, repeats=2):
    """tok/s of the static engine (aisrl.engine.Engine), of aisrl.rollout.generate and of HF `generate` on the same
    prompts: each timed `repeats` times, interleaved, best kept (the machine is shared; noise only slows runs)."""
    model, tok = load_model("smollm2")
    tok.padding_side = "left"
    engine = Engine(model, None, max_len=512)
    rows = []
    for b in batches:
        prompts = [list(p if isinstance(p[0], int) else p["input_ids"]) for p in _prompts(tok, b)]
        runs = _runners(model, tok, engine, prompts)
        best = dict.fromkeys(runs, float("inf"))
        for run in runs.values():
            run(2)  # warm-up: buffers for this batch size
        for _ in range(repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(new_tokens)
                best[name] = min(best[name], time.perf_counter() - t0)
        row = {"batch": b, "new_tokens": new_tokens, "repeats": repeats}
        row |= {f"{name}_tok_s": b * new_tokens / t for name, t in best.items()}
        row |= {"engine_vs_hf": best["hf"] / best["engine"], "generate_vs_hf": best["hf"] / best["generate"]}
        rows.append(row)
        print(row, flush=True)
    return rows


def profile(batch=64, steps=24):
    """Share of the static engine's decode time per op at `batch`: the profile of a call generating 1 + `steps` tokens
    minus that of a call generating 1 (the same prefill), so only the decode steps remain."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, tok = load_model("smollm2")
    engine = Engine(model, None, max_len=512)
    prompts = [list(p if isinstance(p[0], int) else p["input_ids"]) for p in _prompts(tok, batch)]

    def op_seconds(n):
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.generate(prompts, SamplingParams(max_new_tokens=n), eos_id=[])
        return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}

    op_seconds(2)  # warm-up
    base, full = op_seconds(1), op_seconds(1 + steps)
    decode = {k: full[k] - base.get(k, 0.0) for k in full}
    total = sum(decode.values())
    top = sorted(decode.items(), key=lambda kv: -kv[1])[:8]
    return {"ms_per_step": round(1e3 * total / steps, 1)} | {k: round(100 * v / total, 1) for k, v in top}


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


def main(what: str) -> dict:
    """Run one part (throughput, profile or memory), add it to benchmarks/results/engine.json, and write its section
    of BENCHMARKS.md (throughput, memory) with the machine it was measured on."""
    path = ROOT / "benchmarks/results/engine.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[f"machine_{what}"] = machine()  # each part's own: they may be measured on different machines
    where = machine_line(data[f"machine_{what}"])
    if what == "throughput":
        rows = throughput()
        data["throughput"] = rows
        body = (f"Command: `python benchmarks/engine.py throughput`; SmolLM2-135M FP32, {where}, 128 new "
                "tokens per request (EOS ignored), plain sampling (T=1), all three in the same run, best of 2 "
                "interleaved repeats. `Engine` is aisrl.engine's static-cache engine (`rollout.engine=static`), "
                "`generate` is aisrl.rollout.generate on the Hugging Face modules (`rollout.engine=hf`).\n\n"
                "| batch | `Engine` tok/s | `generate` tok/s | HF tok/s | `Engine` vs HF | `generate` vs HF |\n"
                "|---|---|---|---|---|---|\n")  # fmt: skip
        cells = ("{batch} | {engine_tok_s:.0f} | {generate_tok_s:.0f} | {hf_tok_s:.0f} | {engine_vs_hf:.2f}x | "
                 "{generate_vs_hf:.2f}x")  # fmt: skip
        body += "\n".join(f"| {cells.format(**r)} |" for r in rows) + "\n"
        update_section(ROOT / "BENCHMARKS.md", "engine_throughput", body)
    elif what == "profile":
        data["profile_batch64"] = profile()
        print(data["profile_batch64"])
    else:
        m = memory()
        data["memory"] = m
        print(m)
        body = (f"Command: `python benchmarks/engine.py memory`; SmolLM2-135M FP32, {where}, 32 sequences x "
                "(32 prompt + 256 completion) tokens, peak RSS above the loaded model (VmHWM after a reset).\n\n"
                "| method | peak GB |\n|---|---|\n"
                f"| `logprobs(..., micro_batch=8, chunk=64)` | {m['logprobs_peak_gb']:.2f} |\n"
                f"| naive: one forward + full-vocab log_softmax | {m['naive_forward_peak_gb']:.2f} |\n")  # fmt: skip
        update_section(ROOT / "BENCHMARKS.md", "engine_memory", body)
    write_json(path, data)
    return data


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1] not in ("throughput", "profile", "memory")):
        sys.exit("usage: python benchmarks/engine.py [throughput|profile|memory]")
    main(sys.argv[1] if len(sys.argv) > 1 else "throughput")
