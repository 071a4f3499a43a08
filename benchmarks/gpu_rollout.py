"""Real FP8 rollout speed on an NVIDIA GPU (issue 9): our engine in BF16, FP8 W8A8 and FP8 W8A8 + FP8 KV cache
against Hugging Face `generate` in BF16, on randomly initialised Qwen3-8B- and Qwen3-1.7B-shaped models.

    python benchmarks/gpu_rollout.py [run] [shapes=qwen3-8b,qwen3-1.7b] [batches=16,64,128] [prompt=256] [new=512]
                                         [hf=1] [profile=1] [gemm=1] [accuracy=1]
                                         [out=benchmarks/results/gpu_rollout.json]
    python benchmarks/gpu_rollout.py publish [out=benchmarks/results/gpu_rollout.json] [section=gpu_rollout]
                                                                                           # -> BENCHMARKS.md

A run writes its progress to OUT.partial and renames it over OUT only once it is done.

Every request decodes exactly `new` tokens (no EOS), plain sampling at T=1. Throughput = batch * new / wall
seconds from the prompts to the last token (prefill included; CUDA-graph capture excluded by a warm-up
call). Accuracy: next-token logits of each format against our BF16 path (and ours against Hugging Face's) on
64 prefixes, as relative L2 error and the exact KL(BF16 || format) of the T=1 sampling distributions.
The floor: bytes read per decode step (weights once, the KV cache up to the mean length) over the
measured copy bandwidth. The profile: GPU time per kernel class over eager decode steps at batch 64.
"""

import copy
import functools
import sys
import time
from pathlib import Path

import torch

from aisrl.bench.cli import command, flag, number, numbers, subcommand
from aisrl.bench.report import machine, staged_json, update_section
from aisrl.engine import Engine
from aisrl.quant import QuantConfig, quant_config, quantize_
from aisrl.rollout import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
}  # fmt: skip
VARIANTS = {  # name -> engine quantisation
    "bf16": None,
    "fp8_w8a8": "fp8_e4m3_w8a8",
    "fp8_w8a8_kv": "fp8_e4m3_w8a8_kv",
    "fp8_w8a8_kv_head": QuantConfig("fp8_e4m3", activations=True, kv_cache=True, lm_head=True),
}


def _model(shape: str):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)  # fmt: skip
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.eval()


def _sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GB device-to-device copy (median of 10)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        times.append(_sync_time(lambda: b.copy_(a))[0])
    return 2 * a.numel() / sorted(times[2:])[len(times[2:]) // 2]


def floor_ms(model, variant: str, batch: int, prompt: int, new: int, bw: float) -> float:
    """Bytes one decode step must read (weights once; KV cache at the mean length) over the copy bandwidth."""
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "layers." in n)
    fp8 = variant != "bf16"
    w_bytes = body * (1 if fp8 else 2) + head * (1 if variant.endswith("head") else 2)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (1 if "kv" in variant else 2)
    kv_bytes = batch * (prompt + new / 2) * kv_per_token
    return 1e3 * (w_bytes + kv_bytes) / bw


def gemm(log, M=64):
    """Microseconds per GEMM of the Qwen3-8B decode shapes at M rows: BF16, and FP8 rowwise in both layouts."""
    from aisrl import engine_ops as E

    rows = []
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                         "lm_head": (151936, 4096)}.items():  # fmt: skip
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
        lin = E.Linear(n, k, False, "channel", torch.bfloat16, "cuda")
        lin.load([w], None)
        xq = E.fp8_rows(x)
        wt = lin.w.t()
        one = torch.ones((), device="cuda")
        row = {"gemm": name, "n": n, "k": k, "M": M}
        for label, fn in (("bf16", lambda: x @ w.t()), ("fp8_rowwise", lambda: lin(xq)),  # noqa: B023
                          ("fp8_tensorwise", lambda: torch._scaled_mm(xq[0], wt, scale_a=one, scale_b=one,  # noqa: B023
                                                                      out_dtype=torch.bfloat16))):  # fmt: skip
            for _ in range(3):
                fn()
            times = sorted(_sync_time(fn)[0] for _ in range(30))
            row[label + "_us"] = 1e6 * times[15]
            row[label + "_TBs"] = (n * k * (2 if label == "bf16" else 1)) / times[15] / 1e12
        ref = (x.float() @ w.float().t())
        row["fp8_rel_err"] = ((lin(xq).float() - ref).norm() / ref.norm()).item()
        rows.append(row)
        log(row)
    return rows


def attention_sweep(log, B=64, H=32, Hk=8, D=128, length=512):
    """Time the decode kernel's launch settings at an 8B-shaped decode step; install the fastest per cache dtype."""
    import itertools

    from triton.testing import do_bench

    from aisrl import kernels

    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    start = torch.zeros(B, device="cuda", dtype=torch.int32)
    end = torch.full((B,), length, device="cuda", dtype=torch.int32)
    scales = torch.rand(B, Hk, device="cuda") + 0.5
    rows = []
    for kind, dtype in (("wide", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        k = torch.randn(B, Hk, length + 256, D, device="cuda").to(dtype)
        v = torch.randn(B, Hk, length + 256, D, device="cuda").to(dtype)
        best = None
        for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)):
            kernels.DECODE_CONFIG[kind] = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
            try:
                ms = do_bench(lambda: kernels.decode_attention(q, k, v, scales, scales, start, end, 0, D**-0.5),  # noqa: B023
                              warmup=5, rep=20, return_mode="median")  # fmt: skip
            except Exception as e:
                rows.append(dict(kind=kind, BLOCK_N=bn, num_warps=warps, num_stages=stages, error=repr(e)[:200]))
                continue
            rows.append(dict(kind=kind, BLOCK_N=bn, num_warps=warps, num_stages=stages, us=1e3 * ms,
                             TBs=2 * k.element_size() * B * Hk * length * D / (ms * 1e-3) / 1e12))  # fmt: skip
            if best is None or ms < best[0]:
                best = (ms, dict(kernels.DECODE_CONFIG[kind]))
        kernels.DECODE_CONFIG[kind] = best[1]
        log({"attention_best": kind, **best[1], "us": 1e3 * best[0]})
    return rows


def throughput(model, shape, batches, prompt, new, hf, bw, log):

    rows = []
    g = torch.Generator().manual_seed(1)
    for B in batches:
        prompts = torch.randint(1, model.config.vocab_size, (B, prompt), generator=g).tolist()
        params = SamplingParams(new)
        if hf:
            ids = torch.tensor(prompts, device="cuda")
            hf_args = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
                           min_new_tokens=new, top_k=0, top_p=1.0, temperature=1.0)  # fmt: skip
            model.generate(input_ids=ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4)
            sec, out = _sync_time(functools.partial(model.generate, **hf_args))
            assert out.shape[1] == prompt + new
            rows.append(dict(shape=shape, batch=B, variant="hf_generate_bf16", seconds=sec, tok_s=B * new / sec))
            log(rows[-1])
        for name, quant in VARIANTS.items():
            eng = None
            try:
                eng = Engine(model, quant, max_len=prompt + new)
                eng.generate(prompts, SamplingParams(8), seeds=list(range(B)))  # warm-up: graph capture, kernels
                prefill, _ = _sync_time(functools.partial(eng.next_logits, prompts))
                sec, r = _sync_time(functools.partial(eng.generate, prompts, params, seeds=list(range(B))))
                assert int(r.completion_mask.sum()) == B * new
                step_ms = 1e3 * (sec - prefill) / (new - 1)
                rows.append(dict(shape=shape, batch=B, variant=name, seconds=sec, tok_s=B * new / sec,
                                 prefill_s=prefill, decode_step_ms=step_ms, compile_failures=eng.compile_failures(),
                                 floor_step_ms=floor_ms(model, name, B, prompt, new, bw)))  # fmt: skip
            except Exception as e:  # keep the other rows of the run
                rows.append(dict(shape=shape, batch=B, variant=name, error=repr(e)[:500]))
            log(rows[-1])
            del eng
            torch.cuda.empty_cache()
    return rows


def accuracy(model, shape, log, n=64):
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(16, 256, (n,), generator=g).tolist()
    prompts = [torch.randint(1, model.config.vocab_size, (k,), generator=g).tolist() for k in lengths]
    logits = {}
    for name, quant in VARIANTS.items():
        eng = Engine(model, quant, max_len=512)
        logits[name] = eng.next_logits(prompts).double()
        del eng
    from aisrl.rollout import _positions, left_pad

    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        hf = model(input_ids=ids.cuda(), attention_mask=mask.long().cuda(), position_ids=_positions(mask).cuda())
    logits["hf_bf16"] = hf.logits[:, -1].double()
    model.float()  # the FP32 reference (the trainer's precision); BF16 -> FP32 -> BF16 is exact
    with torch.no_grad():
        hf = model(input_ids=ids.cuda(), attention_mask=mask.long().cuda(), position_ids=_positions(mask).cuda())
    ref32 = hf.logits[:, -1].double()
    del hf
    model.bfloat16()
    torch.cuda.empty_cache()
    # the FP8 W8A8 format itself, emulated in FP32 (aisrl.quant fake-quant): separates the format's error from ours
    emu = quantize_(copy.deepcopy(model).float(), quant_config("fp8_e4m3_w8a8"))
    with torch.no_grad():
        out = emu(input_ids=ids.cuda(), attention_mask=mask.long().cuda(), position_ids=_positions(mask).cuda())
    logits["fp8_w8a8_emulated_fp32"] = out.logits[:, -1].double()
    del emu, out
    torch.cuda.empty_cache()
    rows = []
    for name, lg in logits.items():
        rows.append(_compare(shape, name, "hf_fp32", lg, ref32))
        log(rows[-1])
        if name == "bf16":
            continue
        rows.append(_compare(shape, name, "ours_bf16", lg, logits["bf16"]))
        log(rows[-1])
    for name in ("fp8_w8a8", "fp8_w8a8_kv"):  # our real-FP8 path against the format's emulation
        rows.append(_compare(shape, name, "fp8_w8a8_emulated_fp32", logits[name], logits["fp8_w8a8_emulated_fp32"]))
        log(rows[-1])
    return rows


def _compare(shape, name, vs, lg, ref):
    rel = ((lg - ref).norm(dim=-1) / ref.norm(dim=-1)).mean().item()
    lp, lq = ref.log_softmax(-1), lg.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
    std = ref.std(-1).mean().item()
    return dict(shape=shape, variant=name, vs=vs, rel_l2=rel, kl=kl, top1_agree=top1, logit_std=std)


def _us(evt) -> float:
    us = getattr(evt, "self_device_time_total", None)
    return us if us is not None else evt.self_cuda_time_total


def profile(model, shape, batch, prompt, log, steps=6):
    """GPU time per kernel class over eager decode steps (the same kernels the CUDA graph replays)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = []
    prompts = torch.randint(1, model.config.vocab_size, (batch, prompt)).tolist()
    for name in ("bf16", "fp8_w8a8_kv"):
        eng = Engine(model, VARIANTS[name], max_len=prompt + 64, cuda_graphs=False)
        eng.generate(prompts, SamplingParams(4), seeds=list(range(batch)))  # leaves a valid decoding state
        st, params = eng._st, SamplingParams(64)
        eng._decode_step(st, params, eng.max_len)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng._decode_step(st, params, eng.max_len)
            torch.cuda.synchronize()
        classes, n_kernels = {}, 0
        for evt in prof.key_averages():
            us = _us(evt)
            if us <= 0:
                continue
            key = evt.key.lower()
            cls = ("gemm" if any(s in key for s in ("gemm", "cutlass", "xmma", "sm90", "scaled_mm", "f8f8", "nvjet"))
                   else "attention" if "decode_kernel" in key else "elementwise/other")  # fmt: skip
            classes[cls] = classes.get(cls, 0.0) + us / 1e3 / steps
            n_kernels += evt.count
        row = dict(
            shape=shape,
            batch=batch,
            variant=name,
            ms_per_step=classes,
            kernels_per_step=n_kernels / steps,
            top=[(e.key[:80], round(_us(e) / 1e3 / steps, 3)) for e in sorted(prof.key_averages(), key=_us)[-12:]],
        )
        out.append(row)
        log(row)
        del eng
        torch.cuda.empty_cache()
    return out


def run(shapes, batches, prompt, new, hf, prof, out_path, gemms=True, acc=True):
    """All the measurements; `out_path` is replaced only once they are all done (the progress is in OUT.partial)."""
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
    import triton

    data = {"machine": machine(), "triton": triton.__version__, "command": command(__file__), "prompt": prompt,
            "new_tokens": new, "throughput": [], "accuracy": [], "profile": []}  # fmt: skip
    with staged_json(out_path) as save:
        data["copy_bandwidth_TBs"] = bw = copy_bandwidth() / 1e12
        print(data["machine"], "copy TB/s", bw, flush=True)

        def log(row):
            print(row, flush=True)
            save(data)

        if gemms:
            data["gemm"] = gemm(log)
            data["attention_sweep"] = attention_sweep(log)
            from aisrl import kernels

            data["decode_config"] = kernels.DECODE_CONFIG
        for shape in shapes:
            model = _model(shape)
            data["throughput"] += throughput(model, shape, batches, prompt, new, hf, bw * 1e12, log)
            if acc:
                data["accuracy"] += accuracy(model, shape, log)
            if prof and shape == shapes[0]:
                data["profile"] += profile(model, shape, 64, prompt, log)
            del model
            torch.cuda.empty_cache()
        save(data)
    return data


def publish(out_path, section="gpu_rollout"):
    """The run in `out_path` as the BENCHMARKS.md section `section` (another name keeps a re-check beside the
    published table)."""
    import json

    data = json.loads(Path(out_path).read_text())
    m = data["machine"]
    sources = data.get("sources", {"everything": data["command"]})
    lines = []
    for part, cmd in sources.items():
        command, _, remark = cmd.partition(" (")
        lines.append(f"{part[0].upper() + part[1:]}: `{command}`" + (f" ({remark}" if remark else "") + ".")
    lines += ["", f"{m['cuda']}, torch {m['torch']}, Triton {data['triton']}; random-init "
             f"Qwen3-shaped models in BF16, prompt {data['prompt']} + {data['new_tokens']} new tokens per request "
             f"(no EOS), T=1 sampling; measured copy bandwidth {data['copy_bandwidth_TBs']:.2f} TB/s "
             "(read + write).", "",
             "| shape | batch | variant | tok/s | seconds | decode ms/step | floor ms/step | vs our BF16 | vs HF |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    rows = data["throughput"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['variant']} | error: {r['error'][:80]} | | | | | |")
            continue
        same = {x["variant"]: x for x in rows if x["shape"] == r["shape"] and x["batch"] == r["batch"] and "tok_s" in x}
        ours = same.get("bf16", {}).get("tok_s")
        hf = same.get("hf_generate_bf16", {}).get("tok_s")
        f = lambda v, k: f"{v[k]:.2f}" if k in v else ""  # noqa: E731
        vs_ours = f"{r['tok_s'] / ours:.2f}x" if ours else ""
        vs_hf = f"{r['tok_s'] / hf:.2f}x" if hf else ""
        lines.append(f"| {r['shape']} | {r['batch']} | {r['variant']} | {r['tok_s']:.0f} | {r['seconds']:.1f} | "
                     f"{f(r, 'decode_step_ms')} | {f(r, 'floor_step_ms')} | {vs_ours} | {vs_hf} |")  # fmt: skip
    if data["accuracy"]:
        lines += [
            "",
            "Accuracy of the next-token distribution on 64 prefixes (16-255 tokens) of each variant against a "
            "reference:",
            "",
            "| shape | variant | reference | rel. L2 logit error | KL(reference \\|\\| variant) | top-1 agreement |",
            "|---|---|---|---|---|---|",
        ]
    for a in data["accuracy"]:
        if a["variant"] != a["vs"] and not (a["variant"] == "bf16" and a["vs"] == "ours_bf16"):
            lines.append(f"| {a['shape']} | {a['variant']} | {a['vs']} | {a['rel_l2']:.2e} | {a['kl']:.2e} | "
                         f"{a['top1_agree']:.3f} |")  # fmt: skip
    if data.get("gemm"):
        lines += ["", "One GEMM of the Qwen3-8B decoder at 64 rows (median of 30 timed calls, microseconds; TB/s = "
                  "weight bytes / time):", "",
                  "| GEMM | N x K | BF16 us (TB/s) | FP8 rowwise us (TB/s) | FP8 tensorwise us (TB/s) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for g in data["gemm"]:
            cell = lambda k: f"{g[k + '_us']:.0f} ({g[k + '_TBs']:.2f})"  # noqa: B023, E731
            lines.append(f"| {g['gemm']} | {g['n']} x {g['k']} | {cell('bf16')} | {cell('fp8_rowwise')} | "
                         f"{cell('fp8_tensorwise')} |")  # fmt: skip
    if data.get("decode_config"):
        best = {k: min((r for r in data["attention_sweep"] if r["kind"] == k and "us" in r), key=lambda r: r["us"])
                for k in ("wide", "fp8")}  # fmt: skip
        lines += ["", "Decode attention kernel, batch 64 x 512 positions, 32 query / 8 KV heads of 128: fastest launch "
                  f"settings of {len(data['attention_sweep']) // 2} tried, BF16 cache {best['wide']['us']:.0f} us "
                  f"({best['wide']['TBs']:.2f} TB/s), FP8 cache {best['fp8']['us']:.0f} us ({best['fp8']['TBs']:.2f} "
                  "TB/s); aisrl.kernels.DECODE_CONFIG holds them."]  # fmt: skip
    if data["profile"]:
        lines += [
            "",
            "GPU time per decode step by kernel class (eager steps, batch 64, profiler):",
            "",
            "| shape | variant | GEMM ms | attention ms | other ms | kernels/step |",
            "|---|---|---|---|---|---|",
        ]
        for p in data["profile"]:
            c = p["ms_per_step"]
            lines.append(f"| {p['shape']} | {p['variant']} | {c.get('gemm', 0):.2f} | {c.get('attention', 0):.2f} | "
                         f"{c.get('elementwise/other', 0):.2f} | {p['kernels_per_step']:.0f} |")  # fmt: skip
    update_section(ROOT / "BENCHMARKS.md", section, "\n".join(lines))


COMMANDS = {"run": ("shapes", "batches", "prompt", "new", "hf", "profile", "out", "gemm", "accuracy"),
            "publish": ("out", "section")}


def main(argv: list[str]) -> None:
    what, kw = subcommand(argv, COMMANDS)
    out = kw.get("out", str(ROOT / "benchmarks/results/gpu_rollout.json"))
    if what == "publish":
        publish(out, kw.get("section", "gpu_rollout"))
    else:
        run(kw.get("shapes", "qwen3-8b,qwen3-1.7b").split(","), numbers(kw, "batches", [16, 64, 128], low=1),
            number(kw, "prompt", 256, low=1), number(kw, "new", 512, low=1), flag(kw, "hf", True),
            flag(kw, "profile", True), out, flag(kw, "gemm", True), flag(kw, "accuracy", True))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
