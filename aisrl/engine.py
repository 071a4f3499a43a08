"""A static-cache rollout engine for Llama / Mistral / Qwen2 / Qwen3 models: real FP8 GEMMs, an FP8 KV cache
and CUDA graphs on the GPU, the same arithmetic on the CPU.

Why: low-precision rollouts are only worth their mismatch if they are fast, and decoding is bound by the
bytes it reads each step (the weights, then the KV cache). `aisrl.rollout.generate` runs any Hugging Face
model with fake-quantised layers, which is exact but no faster. This engine re-implements the decoder
of the common architectures with
  - FP8 E4M3 W8A8 linears as one `torch._scaled_mm` each, with the numerics of aisrl.quant's fake-quant
    `fp8_e4m3_w8a8` (aisrl.engine_ops.Linear);
  - fused QKV and gate/up projections (one GEMM each, scales stay per output row);
  - the layers `QuantConfig.keep` names as full-precision GEMMs (a fused QKV or gate/up kept whole or not at all);
  - a static (B, H_kv, S, D) KV cache per layer. Optionally it is FP8 E4M3, with per-request, per-head scales
    calibrated on each prompt at prefill, so they follow the weights after every sync. It is read by
    aisrl.kernels.decode_attention without a BF16 copy;
  - the elementwise stages between GEMMs fused by torch.compile on CUDA (aisrl.engine_ops);
  - on CUDA, one captured graph per (batch, sampling settings) for the whole decode step, sampling included;
  - counter-based sampling: request b's uniform at step t is a hash of (seed_b, t). A completion then depends
    only on its seed and prompt, not on its batch or padding (up to the GPU's batch-size-dependent GEMM
    rounding).
`generate` returns `aisrl.rollout.Rollout` with `rollout_logp` under the processed sampling distribution,
like aisrl.rollout.generate (different random streams: the two engines sample different completions).

    engine = Engine(model, "fp8_e4m3_w8a8_kv", max_len=768)   # BF16 on CUDA, FP32 on the CPU
    r = engine.generate(prompts, SamplingParams(512), seeds=seeds, eos_id=tok.eos_token_id)
    seconds = engine.sync(trainer_model)                       # every RL step
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from aisrl.engine_ops import E4M3_MAX, STAGES, CompiledStage, Linear, prefill_attention
from aisrl.kernels import decode_attention, kernel_supports, triton_available
from aisrl.lora import merged_state
from aisrl.quant import PRESETS, QuantConfig, amax_scale, check_keep, is_kept, quant_config
from aisrl.rollout import Rollout, SamplingParams, _positions, check_pad_id, device_of, eos_list, left_pad

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class _State:
    """The static buffers one batch size decodes into (CUDA graphs capture their addresses)."""

    k: list  # per layer (B, Hk, S, D) keys, FP8 or the engine dtype
    v: list
    ks: torch.Tensor  # (L, B, Hk) FP32 key scales per request and head (ones without an FP8 cache)
    vs: torch.Tensor
    tok: torch.Tensor  # (B,) the token fed to the next step
    pos: torch.Tensor  # (B,) its rotary position
    slot: torch.Tensor  # (1,) its cache slot (shared: prompts are left-padded to one width)
    start: torch.Tensor  # (B,) int32 first valid slot (after the padding)
    end: torch.Tensor  # (B,) int32 one past the last slot attention may read
    t: torch.Tensor  # (1,) step counter
    seeds: torch.Tensor  # (B,) int64
    eos: torch.Tensor  # (E,) int64 EOS ids, padded with -1
    done: torch.Tensor  # (B,) bool
    lengths: torch.Tensor  # (B,) int64
    out_ids: torch.Tensor  # (B, max_len) sampled ids, step t in column t
    out_logp: torch.Tensor  # (B, max_len) FP32


def _runs(qc: QuantConfig) -> bool:
    """Whether the engine computes `qc` with real GEMMs: FP8 E4M3 weights and activations, tensor or channel scales."""
    return qc.format == "fp8_e4m3" and qc.activations and qc.granularity != "block"


ENGINE_PRESETS = tuple(sorted(name for name, qc in PRESETS.items() if _runs(qc)))  # what rollout.engine=static runs


def engine_quant(quant: str | QuantConfig | None) -> QuantConfig | None:
    """The engine's quantisation for a preset name / QuantConfig / None; raises for what it cannot run."""
    qc = None if quant in (None, "none") else quant_config(quant) if isinstance(quant, str) else quant
    if qc is not None and not _runs(qc):
        raise ValueError(f"Engine runs real FP8 GEMMs: quant must be 'none' or FP8 E4M3 W8A8 with tensor or "
                         f"channel scales (one of {list(ENGINE_PRESETS)}), not {qc}; "
                         "emulate other formats with aisrl.quant.quantize_ + aisrl.rollout.generate")  # fmt: skip
    return qc


def _check_model(cfg, state: dict, prefix: str, max_len: int) -> None:
    """Refuse architectures the engine would run wrongly rather than silently."""
    if cfg.model_type not in ARCHS:
        raise ValueError(f"Engine supports model types {list(ARCHS)}, not {cfg.model_type!r}; use "
                         "aisrl.rollout.generate (any Hugging Face causal LM) instead")  # fmt: skip
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", False) or (cfg.model_type == "mistral" and window and window < max_len):
        raise ValueError(f"Engine attends to the whole context: this model uses sliding-window attention "
                         f"({window} tokens) below max_len={max_len}")  # fmt: skip
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"Engine computes the rotary table once for max_len, and {kind!r} RoPE scaling changes "
                         "with the sequence length; use aisrl.rollout.generate (rollout.engine=hf)")  # fmt: skip
    if getattr(cfg, "hidden_act", "silu") != "silu" or f"{prefix}layers.0.mlp.gate_proj.bias" in state:
        raise ValueError("Engine supports SiLU MLPs without biases (hidden_act='silu', mlp_bias=False)")


def _check_fp8_device(device: torch.device, dims: dict) -> None:
    """Real FP8 GEMMs need an FP8 GPU and matrix sizes that are multiples of 16: say so before generating."""
    if device.type != "cuda":
        return  # the CPU path computes the same sums in FP32
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"FP8 GEMMs need compute capability >= 8.9 (Ada, Hopper or newer); "
                         f"{torch.cuda.get_device_name(device)} has {major}.{minor}: use quant='none'")  # fmt: skip
    odd = {k: v for k, v in dims.items() if v % 16}
    if odd:
        raise ValueError(f"FP8 GEMMs need dimensions that are multiples of 16; this model has {odd}")
    try:
        x = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(16, 1, device=device)
        torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"this torch ({torch.__version__}) cannot run FP8 GEMMs with per-row scales on "
                         f"{torch.cuda.get_device_name(device)}: {e}") from e  # fmt: skip


def _fp8_of(qc: QuantConfig | None, parent: str, parts: tuple[str, ...]) -> str | None:
    """The FP8 weight scales of the engine linear that fuses `parent` + each of `parts` (q/k/v, gate/up), or None
    when it runs in full precision: no quantisation, or qc.keep keeps every part (a fused GEMM has one format)."""
    if qc is None:
        return None
    names = [f"{parent}{p}" for p in parts]
    kept = [is_kept(n, qc) for n in names]
    if any(kept) and not all(kept):
        raise ValueError(f"the engine fuses {names} into one FP8 GEMM: keep all of them or none ({qc.keep})")
    return None if all(kept) else qc.granularity


class Engine:
    """See the module docstring. `quant`: None / "none" (full precision in the engine's dtype: BF16 on CUDA, as
    GPU rollout engines run, FP32 on the CPU), or an FP8 E4M3 W8A8 preset of aisrl.quant (tensor or channel
    weight scales; `_kv` adds the FP8 KV cache) or an equivalent QuantConfig. `max_len` bounds prompt width +
    new tokens (the cache is allocated at that length); `compile` (default: on CUDA) fuses the elementwise
    stages of the decode step with torch.compile."""

    def __init__(self, model, quant: str | QuantConfig | None = None, *, max_len: int = 2048,
                 device=None, dtype=None, cuda_graphs: bool = True, compile: bool | None = None):  # fmt: skip
        cfg, qc, state = model.config, engine_quant(quant), merged_state(model)
        prefix = "model." if "model.embed_tokens.weight" in state else ""
        _check_model(cfg, state, prefix, max_len)
        self.device = torch.device(device) if device is not None else device_of(model)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.quant, self.kv_fp8, self.max_len = qc, bool(qc and qc.kv_cache), max_len
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.H, self.Hk = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.use_kernel = (self.device.type == "cuda" and triton_available() and kernel_supports(self.D)
                           and self.dtype != torch.float32)  # the Triton kernel computes in BF16  # fmt: skip
        if compile is None:
            compile = self.device.type == "cuda" and triton_available()  # inductor needs Triton on CUDA
        self._fused = {k: CompiledStage(f) for k, f in STAGES.items()} if compile else STAGES
        self.eps, self.sm_scale = cfg.rms_norm_eps, self.D**-0.5
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.eos_id = cfg.eos_token_id
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))  # the head is the embedding: no lm_head tensor
        V = state[f"{prefix}embed_tokens.weight"].shape[0]
        head_fp8 = qc.granularity if qc and qc.lm_head and not is_kept("lm_head", qc) else None
        if qc is not None:  # the names quantize_ matches keep against: the fake-quant copy keeps the same layers
            names = [n.removesuffix(".weight") for n in state if n.endswith("_proj.weight")]
            check_keep(qc, names + (["lm_head"] if qc.lm_head else []), "linear layers")
        self.prefix, self.layers = prefix, []
        for i in range(cfg.num_hidden_layers):
            p = f"{prefix}layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = [state[a + f"{n}_proj.weight"] for n in "qkv"]
            layer = {
                "qkv": Linear(
                    sum(w.shape[0] for w in qkv),
                    cfg.hidden_size,
                    a + "q_proj.bias" in state,
                    _fp8_of(qc, a, ("q_proj", "k_proj", "v_proj")),
                    self.dtype,
                    self.device,
                ),  # fmt: skip
                "o": Linear(cfg.hidden_size, self.H * self.D, a + "o_proj.bias" in state, _fp8_of(qc, a, ("o_proj",)),
                            self.dtype, self.device),  # fmt: skip
                "gate_up": Linear(2 * cfg.intermediate_size, cfg.hidden_size, False,
                                  _fp8_of(qc, m, ("gate_proj", "up_proj")), self.dtype, self.device),  # fmt: skip
                "down": Linear(cfg.hidden_size, cfg.intermediate_size, False, _fp8_of(qc, m, ("down_proj",)),
                               self.dtype, self.device),  # fmt: skip
                "qk_norm": a + "q_norm.weight" in state,
            }
            layer["fp8_in"] = {k: layer[k].fp8 is not None for k in ("qkv", "o", "gate_up", "down")}  # FP8 inputs
            self.layers.append(layer)
        self.head = Linear(V, cfg.hidden_size, False, head_fp8, self.dtype, self.device)
        if qc is not None:  # the sizes of the layers that run in FP8 (those `keep` leaves out may be any size)
            fp8 = {k for layer in self.layers for k in ("qkv", "o", "gate_up", "down") if layer[k].fp8}
            dims = {"hidden_size": cfg.hidden_size}
            dims |= {"intermediate_size": cfg.intermediate_size} if fp8 & {"gate_up", "down"} else {}
            dims |= {"heads * head_dim": self.H * self.D} if fp8 & {"qkv", "o"} else {}
            dims |= {"kv_heads * head_dim": self.Hk * self.D} if "qkv" in fp8 else {}
            _check_fp8_device(self.device, dims | ({"vocab_size": V} if head_fp8 else {}))
        self.small = {}  # embeddings and norm weights, by state name
        self.load(state)
        rot = model.get_decoder().rotary_emb
        pos = torch.arange(max_len, device=rot.inv_freq.device)[None]
        cos, sin = rot(torch.zeros((), device=rot.inv_freq.device), pos)  # (1, max_len, D), scaling included
        self.cos, self.sin = (c[0].to(self.device, self.dtype) for c in (cos.float(), sin.float()))
        self._st, self._graphs = None, {}

    # -- weights ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, state: dict) -> None:
        """(Re-)load weights from a {name: tensor} state (FP8 layers re-quantised), in place."""
        p = self.prefix

        def take(name):
            if name not in state:
                raise ValueError(f"Engine: the trainer has no tensor {name!r}; is it the same architecture?")
            return state[name].detach().to(self.device)  # FP8 layers quantise from it, the rest cast on copy

        for i, layer in enumerate(self.layers):
            a, m = f"{p}layers.{i}.self_attn.", f"{p}layers.{i}.mlp."
            qkv_b = [take(a + f"{n}_proj.bias") for n in "qkv"] if layer["qkv"].b is not None else None
            layer["qkv"].load([take(a + f"{n}_proj.weight") for n in "qkv"], qkv_b)
            o_b = [take(a + "o_proj.bias")] if layer["o"].b is not None else None
            layer["o"].load([take(a + "o_proj.weight")], o_b)
            layer["gate_up"].load([take(m + "gate_proj.weight"), take(m + "up_proj.weight")], None)
            layer["down"].load([take(m + "down_proj.weight")], None)
            names = [f"{p}layers.{i}.input_layernorm.weight", f"{p}layers.{i}.post_attention_layernorm.weight"]
            names += [a + "q_norm.weight", a + "k_norm.weight"] if layer["qk_norm"] else []
            for n in names:
                self._small(n, take(n))
        self._small("embed", take(f"{p}embed_tokens.weight"))
        self._small("norm", take(f"{p}norm.weight"))
        tied = self.tied and "lm_head.weight" not in state  # an untied model missing its head is refused by take
        self.head.load([self.small["embed"] if tied else take("lm_head.weight")], None)

    def _small(self, name, value):
        if name in self.small:
            self.small[name].copy_(value)
        else:
            self.small[name] = value.to(self.dtype).clone()

    @torch.no_grad()
    def sync(self, trainer) -> float:
        """Load the trainer's current weights (a module or a {name: tensor} state); returns the seconds taken."""
        t0 = time.perf_counter()
        self.load(trainer if isinstance(trainer, dict) else merged_state(trainer))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # -- the decoder -----------------------------------------------------------------------------------------
    def _layers(self, x, pos, st: _State, valid=None, width: int = 0):
        """x (B, S, hidden) at rotary positions pos (B, S). Prefill (valid = (B, S) prompt mask) fills cache slots
        [0, S); decode (S = 1) writes slot st.slot and attends to [st.start, st.end). Returns normed (B*S, hidden)."""
        B, S, _ = x.shape
        f = self._fused if valid is None else STAGES  # compiled stages for the decode step only (fixed shapes)
        H, Hk, D, eps = self.H, self.Hk, self.D, self.eps
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # (B, S, 1, D)
        delta = None
        for i, layer in enumerate(self.layers):
            n = f"{self.prefix}layers.{i}."
            fp8 = layer["fp8_in"]
            x, h = f["add_norm"](x, delta, self.small[n + "input_layernorm.weight"], eps, fp8["qkv"])
            qn = self.small.get(n + "self_attn.q_norm.weight")
            kn = self.small.get(n + "self_attn.k_norm.weight")
            qkv = layer["qkv"](h)  # (B*S, (H + 2 Hk) D)
            if valid is not None and self.kv_fp8:  # calibrate each request's per-head scales on its own prompt
                _, _, _, k, v = f["qkv"](qkv, qn, kn, cos, sin, st.ks[i], st.vs[i], (B, S, H, Hk, D), eps, False)
                for t, sc in ((k, st.ks[i]), (v, st.vs[i])):
                    amax = t.abs().masked_fill(~valid[:, :, None, None], 0).amax(dim=(1, 3)).float()  # (B, Hk)
                    sc.copy_(amax_scale(amax, E4M3_MAX))  # 1 where amax is 0 or underflows; NaN stays NaN
            q, kq, vq, _, _ = f["qkv"](qkv, qn, kn, cos, sin, st.ks[i], st.vs[i], (B, S, H, Hk, D), eps, self.kv_fp8)
            if valid is None:
                for cache, new in ((st.k[i], kq), (st.v[i], vq)):  # FP8 bytes copied as bytes (CPU has no FP8 copy)
                    _bytes(cache).index_copy_(2, st.slot, _bytes(new))
                a = decode_attention(q[:, 0], st.k[i], st.v[i], st.ks[i], st.vs[i], st.start, st.end, width,
                                     self.sm_scale, use_kernel=self.use_kernel)  # fmt: skip  (B, H, D)
            else:
                st.k[i][:, :, :S], st.v[i][:, :, :S] = kq, vq
                kd, vd = kq, vq  # attend to what was stored: FP8 bytes dequantised, a wide cache as is
                if self.kv_fp8:
                    kd = kq.to(self.dtype) * st.ks[i][:, :, None, None].to(self.dtype)
                    vd = vq.to(self.dtype) * st.vs[i][:, :, None, None].to(self.dtype)
                a = prefill_attention(q, kd, vd, valid, self.sm_scale)
            delta = layer["o"](f["quant"](a.reshape(B * S, H * D), fp8["o"])).view(B, S, -1)
            x, h = f["add_norm"](x, delta, self.small[n + "post_attention_layernorm.weight"], eps, fp8["gate_up"])
            delta = layer["down"](f["silu_mul"](layer["gate_up"](h), fp8["down"])).view(B, S, -1)
        return f["add_norm"](x, delta, self.small["norm"], eps, False)[1]

    def _emit(self, st: _State, h_last, params: SamplingParams, f=STAGES):
        """Sample the next token of every row from the final hidden states (B, hidden), record it, advance."""
        tok, lp = f["sample"](self.head(h_last), st.seeds, st.t, params)
        live = ~st.done
        st.out_ids.index_copy_(1, st.t, torch.where(live, tok, st.out_ids.index_select(1, st.t)[:, 0])[:, None])
        st.out_logp.index_copy_(1, st.t, torch.where(live, lp, torch.zeros_like(lp))[:, None])
        st.lengths.add_(live.long())
        st.done.logical_or_(torch.isin(tok, st.eos) & live)
        st.tok.copy_(tok)
        st.t.add_(1)

    def _decode_step(self, st: _State, params: SamplingParams, width: int):
        h = self._layers(self.small["embed"][st.tok][:, None], st.pos[:, None], st, width=width)  # (B, hidden)
        self._emit(st, h, params, self._fused)
        st.pos.add_(1)
        st.slot.add_(1)
        st.end.add_(1)

    # -- generation ------------------------------------------------------------------------------------------
    def _state(self, B: int, n_eos: int) -> _State:
        st = self._st
        if st is None or st.tok.shape[0] != B or st.eos.numel() < n_eos:
            self._graphs.clear()  # their buffers are about to be freed
            dev, L = self.device, len(self.layers)
            kv_dtype = torch.float8_e4m3fn if self.kv_fp8 else self.dtype
            shape = (B, self.Hk, self.max_len, self.D)
            z = lambda *s, dtype=torch.long: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
            st = self._st = _State(
                [torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in range(L)],
                [torch.zeros(shape, dtype=kv_dtype, device=dev) for _ in range(L)],
                torch.ones(L, B, self.Hk, device=dev), torch.ones(L, B, self.Hk, device=dev),
                z(B), z(B), z(1), z(B, dtype=torch.int32), z(B, dtype=torch.int32), z(1), z(B), z(max(8, n_eos)),
                z(B, dtype=torch.bool), z(B), z(B, self.max_len), z(B, self.max_len, dtype=torch.float32),
            )  # fmt: skip
        return st

    def _graph(self, st: _State, params: SamplingParams):
        key = (params.temperature, params.top_k, params.top_p, params.greedy)
        if key not in self._graphs:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm up (kernel compilation, library handles) outside the capture
                self._warm_up(st, params)
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._decode_step(st, params, self.max_len)
            self._graphs[key] = g
        return self._graphs[key]

    def _warm_up(self, st: _State, params: SamplingParams, steps: int = 2):
        """Decode `steps` throw-away steps from slot 0 (whatever the last call left in the buffers, e.g. a full
        cache), then leave the counters at 0: generate() sets every buffer before it decodes."""
        for _ in range(steps):
            for buf in (st.t, st.slot, st.pos, st.start, st.lengths):
                buf.zero_()
            st.end.fill_(1)
            st.done.zero_()
            self._decode_step(st, params, 1)
        st.t.zero_()

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | None = None, *,
                 seeds: list[int] | None = None, pad_id: int | None = None, eos_id: int | list[int] | None = None,
                 tokenizer=None) -> Rollout:  # fmt: skip
        """Sample one completion per prompt (stops at EOS or max_new_tokens); see the module docstring. As in
        aisrl.rollout.generate, pad_id / eos_id default to the model config's and eos_id=[] disables EOS."""
        params = params or SamplingParams()
        pad_id = self.pad_id if pad_id is None else pad_id
        eos_id = self.eos_id if eos_id is None else eos_id
        if params.stop:
            raise ValueError("Engine stops at EOS tokens only; drop the stop strings or use aisrl.rollout.generate")
        check_pad_id(pad_id, self.small["embed"].shape[0])
        ids, pmask = left_pad(prompts, pad_id)
        B, P = ids.shape
        T = params.max_new_tokens
        if self.max_len < P + T:
            raise ValueError(f"prompt width {P} + max_new_tokens {T} exceeds the engine's max_len={self.max_len}")
        seeds = list(range(B)) if seeds is None else [int(s) for s in seeds]
        if len(seeds) != B:
            raise ValueError(f"need one seed per prompt: {len(seeds)} seeds for {B} prompts")
        if any(not -(2**63) <= s < 2**63 for s in seeds):  # the engine keeps them as int64
            raise ValueError(f"Engine seeds must fit in 64 signed bits, [-2**63, 2**63); got {max(seeds, key=abs)}")
        self._check_ids(ids, pmask)
        eos = eos_list(eos_id)
        st = self._state(B, len(eos))
        graph = self._graph(st, params) if self.cuda_graphs else None
        dev = self.device
        ids, pmask = ids.to(dev), pmask.to(dev)
        pos = _positions(pmask)
        eos_pad = eos + [-1] * (st.eos.numel() - len(eos))
        values = {"seeds": torch.tensor(seeds), "eos": torch.tensor(eos_pad), "start": P - pmask.sum(-1),
                  "end": torch.full((B,), P + 1), "pos": pos[:, -1] + 1, "slot": torch.tensor([P]),
                  "t": torch.zeros(1), "lengths": torch.zeros(B)}  # fmt: skip
        for name, value in values.items():
            getattr(st, name).copy_(value)
        st.done.zero_()
        st.out_ids.fill_(pad_id)
        st.out_logp.zero_()
        h = self._layers(self.small["embed"][ids], pos, st, valid=pmask)  # prefill
        self._emit(st, h.view(B, P, -1)[:, -1], params)
        for t in range(1, T):
            if t % 8 == 0 and bool(st.done.all()):  # one host synchronisation every 8 steps
                break
            if graph is not None:
                graph.replay()
            else:
                self._decode_step(st, params, P + t)  # slots [0, P + t): this step's span ends there
        lengths = st.lengths.cpu()
        T_used = int(lengths.max())
        cmask = torch.arange(T_used)[None] < lengths[:, None]
        out_logp = st.out_logp[:, :T_used].cpu()
        out_ids = st.out_ids[:, :T_used].to("cpu", copy=True)  # a copy: the buffers are reused by the next call
        return Rollout(ids.cpu(), pmask.cpu(), out_ids, cmask, torch.where(cmask, out_logp, 0.0))

    def compile_failures(self) -> dict:
        """{stage: why} for decode stages torch.compile could not fuse (they run eagerly)."""
        return {k: f.failure for k, f in self._fused.items() if getattr(f, "failure", None)}

    def _check_ids(self, ids: torch.Tensor, pmask: torch.Tensor) -> None:
        """Prompt token ids must index the vocabulary: a negative one would wrap around to the last rows silently."""
        V, real = self.small["embed"].shape[0], ids[pmask]
        if real.numel() and (real.min() < 0 or real.max() >= V):
            bad = real[(real < 0) | (real >= V)][0].item()
            raise ValueError(f"prompt token id {bad} is outside this model's vocabulary [0, {V})")

    @torch.no_grad()
    def next_logits(self, prompts: list[list[int]], pad_id: int = 0) -> torch.Tensor:
        """(B, V) FP32 logits of the token after each prompt (one prefill): for accuracy checks across formats."""
        ids, pmask = left_pad(prompts, pad_id)
        if ids.shape[1] > self.max_len:
            raise ValueError(f"prompt width {ids.shape[1]} exceeds the engine's max_len={self.max_len}")
        self._check_ids(ids, pmask)
        st = self._state(len(prompts), 0)
        ids, pmask = ids.to(self.device), pmask.to(self.device)
        h = self._layers(self.small["embed"][ids], _positions(pmask), st, valid=pmask)
        return self.head(h.view(len(prompts), ids.shape[1], -1)[:, -1]).float()


def _bytes(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
