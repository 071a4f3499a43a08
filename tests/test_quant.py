"""Fake-quant formats against torch's real float8 casts and the formats' definitions; quantize_ and sync."""

import copy

import pytest
import torch
from torch import nn

from aisrl.quant import (
    ACT_FORMATS,
    PRESETS,
    FakeQuantLinear,
    QuantConfig,
    fake_float,
    kept_fraction,
    quant_config,
    quantize_,
    quantize_fp8,
    quantize_int,
    quantize_mxfp4,
    quantize_nvfp4,
    sync_weights,
)

E2M1 = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}


def _values():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(50_000, generator=g) * s for s in (1e-4, 1e-2, 1.0, 50.0, 1e3, 1e5)])
    edges = [0.0, -0.0, 448.0, 449.0, 464.0, 480.0, 57344.0, 61439.0, 1e9, -1e9, 2**-9, 2**-10, 3 * 2**-11,
             2**-6, 2**-16, 2**-17, 2**-14 * 1.5]  # fmt: skip
    return torch.cat([x, torch.tensor(edges)])


def test_e4m3_equals_torch_float8_cast_bit_for_bit():
    x = _values()
    ours = fake_float(x, "e4m3")
    # torch's cast past the range differs by version (NaN in 2.11, saturation in 2.13): compare within the range,
    # and check that ours saturates there, as the engine's clamp-then-cast does
    inside = x.abs() <= 448
    torch.testing.assert_close(ours[inside], x[inside].to(torch.float8_e4m3fn).float(), rtol=0, atol=0)
    assert torch.equal(ours[~inside], 448 * x[~inside].sign()) and (~inside).sum() > 80_000


def test_e5m2_equals_torch_cast_with_saturation():
    x = _values()
    ours = fake_float(x, "e5m2")
    # real quantisation kernels saturate (satfinite); torch's plain E5M2 cast overflows to inf instead
    torch.testing.assert_close(ours, x.clamp(-57344, 57344).to(torch.float8_e5m2).float(), rtol=0, atol=0)
    assert ours.abs().max() == 57344.0


def test_e2m1_grid():
    x = torch.linspace(-10, 10, 4001)
    q = fake_float(x, "e2m1")
    assert set(q.abs().tolist()) == E2M1
    assert fake_float(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0]), "e2m1").tolist() == [0.0, 1.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("fmt,qmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_fp8_scale_granularities(fmt, qmax):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    t = quantize_fp8(w, fmt, "tensor")
    assert t.abs().max() == pytest.approx(w.abs().max().item(), rel=1e-6)  # amax maps exactly to qmax
    c = quantize_fp8(w, fmt, "channel")
    torch.testing.assert_close(c.abs().amax(1), w.abs().amax(1))  # one scale per output channel
    b = quantize_fp8(w, fmt, "block")
    assert b.shape == w.shape
    for i in range(0, 300, 128):  # 3 x 2 blocks of 128 x 128 (the last ones partial)
        for j in range(0, 200, 128):
            blk, ref = b[i : i + 128, j : j + 128], w[i : i + 128, j : j + 128]
            assert blk.abs().max() == pytest.approx(ref.abs().max().item(), rel=1e-6)
            s = ref.abs().max() / qmax
            assert torch.equal(fake_float(blk / s, fmt), blk / s) or torch.allclose(fake_float(blk / s, fmt), blk / s)
    rel = lambda q: ((q - w).norm() / w.norm()).item()  # noqa: E731
    assert rel(b) <= rel(t) * 1.05 and rel(c) <= rel(t) * 1.05  # finer scales are no worse


def test_int_formats():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 256, generator=g)
    q8 = quantize_int(w, 8)
    s8 = w.abs().amax(1, keepdim=True) / 127
    assert torch.allclose(q8 / s8, torch.round(q8 / s8), atol=1e-4) and (q8 - w).abs().le(s8 / 2 + 1e-6).all()
    q4 = quantize_int(w, 4, group=128)
    s4 = w.view(16, 2, 128).abs().amax(-1, keepdim=True) / 7
    levels = q4.view(16, 2, 128) / s4
    assert torch.allclose(levels, torch.round(levels), atol=1e-4) and levels.abs().max() <= 7 + 1e-4
    assert ((q4.view(16, 2, 128) - w.view(16, 2, 128)).abs() <= s4 / 2 + 1e-6).all()


def test_mxfp4_power_of_two_scales_and_grid():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 64, generator=g) * 3
    q = quantize_mxfp4(w).view(8, 2, 32)
    amax = w.view(8, 2, 32).abs().amax(-1, keepdim=True)
    s = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    assert set((q / s).abs().flatten().tolist()) <= E2M1
    x = w.view(8, 2, 32)
    inside = x.abs() <= 6 * s
    assert ((q - x).abs() <= s + 1e-6)[inside].all()  # half of E2M1's widest gap (2), times the scale
    assert torch.equal(q[~inside], (6 * s).expand_as(x)[~inside] * x[~inside].sign())  # OCP MX saturates
    assert (~inside).any()  # the spec's scale leaves (6s, 8s) to saturation: exercised here


def test_nvfp4_fp8_block_scales_and_grid():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(4, 64, generator=g)
    q = quantize_nvfp4(w).view(4, 4, 16)
    gscale = w.abs().max() / (448 * 6)
    bs = fake_float((w.view(4, 4, 16) / gscale).abs().amax(-1, keepdim=True) / 6, "e4m3")
    # each block: E2M1 values of w / (its E4M3 scale x the tensor scale), times those scales, exactly
    codes = fake_float(w.view(4, 4, 16) / gscale / bs, "e2m1")
    assert set(codes.abs().flatten().tolist()) <= E2M1 and torch.equal(q, codes * bs * gscale)
    rel = (q.flatten() - w.flatten()).norm() / w.norm()
    assert 0.0 < rel < 0.2


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 10, bias=False)

    def forward(self, x):
        return self.lm_head(torch.relu(self.body(self.emb(x))))


def test_quantize_keeps_head_by_default_and_lists_formats():
    m = quantize_(Toy(), quant_config("fp8_e4m3_w8a8"))
    assert isinstance(m.body, FakeQuantLinear) and isinstance(m.lm_head, nn.Linear)
    assert isinstance(quantize_(Toy(), quant_config("int4", lm_head=True)).lm_head, FakeQuantLinear)
    with pytest.raises(ValueError, match=r"unknown format 'fp9'; choose from \[.*'fp8_e4m3'"):
        QuantConfig("fp9")
    with pytest.raises(ValueError, match=r"unknown quantisation preset 'fp8'; choose from"):
        quant_config("fp8")
    with pytest.raises(ValueError, match=r"activations=True needs one of \['bf16', 'fp8_e4m3'.*'nvfp4'\], not 'int4'"):
        QuantConfig("int4", activations=True)
    assert {"fp8_e4m3_w8a8", "fp8_e5m2_w8a8", "int8_w8a8", "int4", "mxfp4", "nvfp4", "bf16"} <= set(PRESETS)
    for bad in (0, -5):  # 0 used to mean one scale per row, silently; -5 failed only inside quantize_
        with pytest.raises(ValueError, match=f"group_size must be >= 1 .*, got {bad}"):
            quant_config("int4", group_size=bad)


def test_bf16_w16a16_rounds_weights_and_inputs_to_bf16_by_hand():
    # the high-precision reference of a GPU study: BF16 GEMM operands, FP32 accumulation. BF16 is the top 16 bits of
    # an FP32, rounded to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then clear the low 16 bits
    def bf16(t):
        bits = t.contiguous().view(torch.int32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & ~0xFFFF).view(torch.float32)

    lin = nn.Linear(24, 6)
    x = torch.randn(4, 24) * 3
    x[0, 0] = 1 + 2**-8  # a tie: rounds to even (1.0); and 1 + 3 * 2**-8 rounds up to 1 + 2**-6
    x[0, 1] = 1 + 3 * 2**-8
    assert bf16(x)[0, 0] == 1.0 and bf16(x)[0, 1] == 1 + 2**-6
    fq = FakeQuantLinear(lin, quant_config("bf16_w16a16"))
    torch.testing.assert_close(fq(x), bf16(x) @ bf16(lin.weight.detach()).T + lin.bias.detach())
    assert not torch.equal(fq(x), lin(x).detach())  # it does round
    weights_only = FakeQuantLinear(lin, quant_config("bf16"))(x)
    torch.testing.assert_close(weights_only, x @ bf16(lin.weight.detach()).T + lin.bias.detach())


def test_w8a8_forward_by_hand():
    lin = nn.Linear(8, 4)
    fq = FakeQuantLinear(lin, quant_config("fp8_e4m3_w8a8"))
    x = torch.randn(3, 8)
    sx = x.abs().amax(-1, keepdim=True) / 448
    xq = fake_float(x / sx, "e4m3") * sx
    wq = quantize_fp8(lin.weight.detach(), "e4m3", "channel")
    torch.testing.assert_close(fq(x), xq @ wq.T + lin.bias.detach())


def test_sync_weights_tracks_trainer_updates():
    torch.manual_seed(0)
    trainer = Toy()
    rollout = quantize_(copy.deepcopy(trainer), quant_config("fp8_e4m3"))
    x = torch.tensor([1, 2, 3])
    opt = torch.optim.SGD(trainer.parameters(), lr=0.5)
    trainer(x).sum().backward()
    opt.step()
    before = rollout(x)
    sync_weights(trainer, rollout)
    after = rollout(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(rollout.body.weight, quantize_fp8(trainer.body.weight.detach(), "e4m3", "channel"))
    torch.testing.assert_close(rollout.emb.weight, trainer.emb.weight.detach())  # unquantised: copied
    torch.testing.assert_close(after, trainer(x).detach(), atol=0.1, rtol=0.1)  # FP8 is close, not equal
    assert not any(p.requires_grad for p in rollout.parameters())


def test_w4a4_quantises_activations_in_32_blocks():
    from aisrl.quant import quantize_mxfp4

    torch.manual_seed(0)
    lin = nn.Linear(64, 8)
    x = torch.randn(3, 5, 64)
    q = FakeQuantLinear(lin, quant_config("mxfp4_w4a4"))
    xq = quantize_mxfp4(x.reshape(15, 64)).reshape(3, 5, 64)
    assert len(torch.unique(xq[0, 0, :32].abs())) <= 8  # E2M1 has 8 magnitudes per shared block scale
    assert torch.equal(q.weight, quantize_mxfp4(lin.weight.detach()))  # the stored weight is the MXFP4 one
    assert torch.equal(q(x), nn.functional.linear(xq, q.weight, q.bias))
    assert not torch.equal(q(x), FakeQuantLinear(lin, quant_config("mxfp4"))(x))  # the input really is quantised


def test_nvfp4_activations_round_each_token_on_its_own():
    # per-row activation scales: a token's rounding never depends on the rest of its batch (a batch-wide scale would
    # let one large row coarsen the others' grid)
    torch.manual_seed(0)
    lin = nn.Linear(64, 8)
    q = FakeQuantLinear(lin, quant_config("nvfp4_w4a4"))
    x = torch.randn(2, 64)
    loud = torch.cat([x[:1], 100 * x[1:]])
    torch.testing.assert_close(q(loud)[:1], q(x[:1]), rtol=0, atol=1e-6)  # (GEMM rounding of another batch size)


def test_mxfp4_block_exponent_is_exact_just_below_a_power_of_two():
    """floor(log2 amax) by float log2 rounds 7.9999995 up to 3 and doubles the block scale; the spec's scale is
    2^(2 - 2) = 1, so the block quantises on the unit E2M1 grid: 7.9999995 saturates to 6, 1.4 -> 1.5, 0.3 -> 0.5."""
    top = torch.nextafter(torch.tensor(8.0), torch.tensor(0.0)).item()
    q = quantize_mxfp4(torch.tensor([[top, 1.4, 0.3] + [0.0] * 29]))
    assert q[0, :3].tolist() == [6.0, 1.5, 0.5]


def test_a_bf16_model_keeps_bf16_activations_through_fake_quant_layers():
    from aisrl.models import tiny_model

    model = tiny_model().to(torch.bfloat16)
    rollout = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3_w8a8"))  # the head stays a bf16 Linear
    ids = torch.tensor([[3, 4, 5]])
    logits = rollout(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    layer = rollout.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features, dtype=torch.bfloat16)
    expected = ACT_FORMATS[layer.cfg.format](x.float()) @ layer.weight.T  # FP32 GEMM of rounded operands
    torch.testing.assert_close(layer(x), expected.to(torch.bfloat16), rtol=0, atol=0)
    # a rollout copy cast after quantize_ (its FP32 buffers with it) still runs (before: a dtype mismatch in the GEMM)
    cast = quantize_(copy.deepcopy(model).float(), quant_config("fp8_e4m3_w8a8")).to(torch.bfloat16)
    assert cast.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert torch.isfinite(cast(ids).logits).all()


def test_sync_reaches_a_quantised_head_tied_to_the_embeddings():
    from aisrl.models import tiny_model

    model = tiny_model(tie_word_embeddings=True)
    rollout = quantize_(copy.deepcopy(model), quant_config("fp8_e4m3", lm_head=True))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2.0)  # the tied head changes with it
    sync_weights(model, rollout)
    torch.testing.assert_close(rollout.lm_head.weight, quantize_fp8(model.lm_head.weight.detach(), "e4m3", "channel"))


EIGHT_BIT = sorted(n for n in PRESETS if n.startswith(("fp8_", "int8")) and not n.endswith("_kv"))


@pytest.mark.parametrize("name", EIGHT_BIT)
def test_eight_bit_presets_forward_by_hand(name):
    # every 8-bit preset does what its name says: format and weight scales (per channel unless _tensor / _block; the
    # weight quantisers are checked against torch's casts above) and, with _w8a8, activations by hand, one scale per
    # token, amax / qmax (448 for E4M3, 57344 for E5M2, 127 for INT8)
    fmt = "int8" if name.startswith("int8") else name[4:8]
    gran = "tensor" if "_tensor" in name else "block" if "_block" in name else "channel"
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(160, 136)  # neither a multiple of 128: partial blocks
    x = torch.randn(5, 160, generator=g) * torch.logspace(-2, 2, 5).unsqueeze(1)
    wq = quantize_int(lin.weight.detach(), 8) if fmt == "int8" else quantize_fp8(lin.weight.detach(), fmt, gran)
    xq = x
    if name.endswith("_w8a8"):
        qmax = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0}[fmt]
        s = x.abs().amax(-1, keepdim=True) / qmax  # (5, 1)
        xq = (x / s).round().clamp(-127, 127) * s if fmt == "int8" else fake_float(x / s, fmt) * s
        assert not torch.equal(xq, x)
    torch.testing.assert_close(FakeQuantLinear(lin, quant_config(name))(x), xq @ wq.T + lin.bias.detach())


class TwoBlocks(nn.Module):
    """Named like a decoder: blocks.0.attn, blocks.0.mlp, blocks.1.attn, blocks.1.mlp, then lm_head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": nn.Linear(16, 16), "mlp": nn.Linear(16, 16)}) for _ in "ab")
        self.lm_head = nn.Linear(16, 5, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = x + torch.tanh(b["mlp"](torch.tanh(b["attn"](x))))
        return self.lm_head(x)


def test_keep_leaves_the_named_layers_in_full_precision():
    model, x = TwoBlocks(), torch.randn(3, 16)
    cfg = quant_config("nvfp4", keep=["blocks.0.*", "blocks.1.mlp"])  # a list, as YAML gives it, becomes a tuple
    assert cfg.keep == ("blocks.0.*", "blocks.1.mlp")
    copy_ = quantize_(copy.deepcopy(model), cfg)
    kinds = {n: type(m).__name__ for n, m in copy_.named_modules() if isinstance(m, (nn.Linear, FakeQuantLinear))}
    assert kinds == {"blocks.0.attn": "Linear", "blocks.0.mlp": "Linear", "blocks.1.attn": "FakeQuantLinear",
                     "blocks.1.mlp": "Linear", "lm_head": "Linear"}  # fmt: skip
    # by hand: the same model with only blocks.1.attn's weight rounded to NVFP4 (a weight-only format)
    by_hand = copy.deepcopy(model)
    with torch.no_grad():
        by_hand.blocks[1]["attn"].weight.copy_(quantize_nvfp4(model.blocks[1]["attn"].weight))
    torch.testing.assert_close(copy_(x), by_hand(x), atol=1e-6, rtol=0)
    assert not torch.allclose(copy_(x), model(x), atol=1e-4)
    assert kept_fraction(model, cfg) == 0.75  # 3 of the 4 equal-sized quantisable layers; the head is not one


def test_sync_copies_kept_layers_exactly_and_requantises_the_rest():
    trainer = TwoBlocks()
    rollout = quantize_(copy.deepcopy(trainer), quant_config("fp8_e4m3", keep=("blocks.1.*",)))
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    sync_weights(trainer, rollout)
    assert torch.equal(rollout.blocks[1]["attn"].weight, trainer.blocks[1]["attn"].weight)  # unrounded
    want = quantize_fp8(trainer.blocks[0]["mlp"].weight.detach(), "e4m3", "channel")
    assert torch.equal(rollout.blocks[0]["mlp"].weight, want)


def test_bad_keep_lists_fail_with_the_pattern_and_the_layer_names():
    with pytest.raises(ValueError, match=r"keep pattern 'blocks.2.\*' matches none of this model's quantisable "
                                         r"layers \(blocks.0.attn, blocks.0.mlp, blocks.1.attn, blocks.1.mlp\)"):
        quantize_(TwoBlocks(), quant_config("int4", keep=("blocks.0.attn", "blocks.2.*")))
    with pytest.raises(ValueError, match="keep pattern 'lm_head' matches none"):  # the head is not quantised anyway
        quantize_(TwoBlocks(), quant_config("int4", keep=("lm_head",)))
    with pytest.raises(ValueError, match=r"no nn.Linear layers to quantise in this model \(keep names them all\)"):
        quantize_(TwoBlocks(), quant_config("int4", keep=("blocks.*",)))
    for bad in ("blocks.0.attn", ("",), (3,)):
        with pytest.raises(ValueError, match="keep must be a list of non-empty module-name patterns"):
            quant_config("int4", keep=bad)


def test_non_finite_values_poison_their_own_group_only_and_never_rescale_others():
    from aisrl.quant import quantize_fp8, quantize_mxfp4, quantize_nvfp4

    inf, nan = float("inf"), float("nan")
    # MXFP4 (OCP MX v1.0): a block holding inf or NaN has E8M0 scale NaN, so the whole block is NaN
    for bad in (inf, nan):
        w = torch.zeros(2, 32)
        w[0, :3] = torch.tensor([bad, 1.0, 0.3])
        w[1, :2] = torch.tensor([1.0, 0.3])
        q = quantize_mxfp4(w)
        assert q[0].isnan().all()
        assert q[1, :2].tolist() == [1.0, 0.25]  # scale 2^(0 - 2): 1.0 -> 4 * 2^-2; 0.3 -> 1 * 2^-2 (nearest E2M1)
    # a per-tensor scale over a NaN is NaN: every value is NaN, not rescaled by a fallback scale of 1
    q = quantize_fp8(torch.tensor([[nan, 0.0], [1000.0, 0.001]]), "e4m3", "tensor")
    assert q.isnan().all()
    q = quantize_nvfp4(torch.tensor([[nan] + [1.0] * 15, [1.0] * 16]))
    assert q.isnan().all()
    # per-channel scales keep a NaN in its own row
    q = quantize_fp8(torch.tensor([[nan, 1.0], [2.0, 1.0]]), "e4m3", "channel")
    assert q[0].isnan().all() and q[1].tolist() == [2.0, 1.0]


def test_a_group_whose_scale_underflows_rounds_to_zero_not_nan():
    # amax / qmax below FP32's smallest subnormal is 0: dividing by it made 1e-44 inf and 0 NaN, one NaN per GEMM row
    from aisrl.engine_ops import fp8_rows
    from aisrl.quant import quantize_act, quantize_fp8, quantize_int, quantize_nvfp4

    w = torch.tensor([[1e-44, 0.0, -1e-44], [1.0, -1.0, 0.0]])
    for q in (quantize_fp8(w, "e4m3", "channel"), quantize_int(w, 8), quantize_nvfp4(w, per_row=True),
              quantize_act(w, "e4m3"), quantize_act(w, "e5m2")):  # fmt: skip
        assert q[0].tolist() == [0.0, 0.0, 0.0] and q[1].tolist() == [1.0, -1.0, 0.0]
    assert quantize_fp8(w[:1], "e4m3", "tensor").tolist() == [[0.0, 0.0, 0.0]]
    values, scales = fp8_rows(w)
    assert (values.float() * scales).tolist() == [[0.0, 0.0, 0.0], [1.0, -1.0, 0.0]]


def test_quantising_a_quantised_model_is_refused():
    # a second quantize_ found no nn.Linear left ("no layers") or, with lm_head=True, quantised the head alone in the
    # new format while quant_config claimed every layer was in it
    from aisrl.quant import QuantConfig, quantize_

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    quantize_(model, QuantConfig(lm_head=True))
    with pytest.raises(ValueError, match=r"quantised already \(fp8_e4m3\).*fresh copy"):
        quantize_(model, QuantConfig(format="int8", lm_head=True))
    assert model.quant_config.format == "fp8_e4m3"


def test_mxfp4_scale_stays_within_e8m0():
    from aisrl.quant import quantize_mxfp4

    # amax 1e-39: floor(log2) = -130, minus 2 is -132, clamped to E8M0's smallest exponent -127.
    # 1e-39 / 2^-127 = 0.170, below half of E2M1's smallest step 0.5 (0.25): it rounds to 0
    w = torch.zeros(1, 32)
    w[0, 0] = 1e-39
    assert quantize_mxfp4(w)[0, 0].item() == 0.0
    w[0, 0] = 3 * 2.0**-127  # exactly representable at the smallest scale: E2M1 3 x 2^-127
    assert quantize_mxfp4(w)[0, 0].item() == 3 * 2.0**-127


def test_bf16_inputs_are_quantised_in_fp32():
    from aisrl.quant import quantize_act, quantize_fp8, quantize_int, quantize_nvfp4

    x = torch.tensor([[5.0, 1.0]])
    for fn in (lambda t: quantize_int(t, 8), lambda t: quantize_fp8(t, "e4m3", "channel"), quantize_nvfp4,
               lambda t: quantize_act(t, "e4m3")):  # fmt: skip
        got, ref = fn(x.to(torch.bfloat16)), fn(x)
        assert got.dtype == torch.float32 and torch.equal(got, ref)
    # INT8: scale 5/127, 1.0 / scale = 25.4 -> level 25 -> 25 * 5/127 = 0.98425 (bf16 arithmetic gave level 26)
    assert quantize_int(x.to(torch.bfloat16), 8)[0, 1].item() == pytest.approx(25 * 5 / 127, rel=1e-6)


def test_a_bare_linear_and_a_trainer_without_the_bias_are_refused_by_name():
    # before: setattr(model, "", ...) added a child named "" and left the layer in full precision, marked quantised
    with pytest.raises(ValueError, match=r"a bare nn.Linear is not one; wrap it in a container"):
        quantize_(nn.Linear(64, 8), quant_config("nvfp4"))
    wrapped = quantize_(nn.Sequential(nn.Linear(64, 8)), quant_config("nvfp4"))
    assert isinstance(wrapped[0], FakeQuantLinear)
    # before: a bare KeyError on the bias
    rollout = quantize_(nn.Sequential(nn.Linear(64, 8)), quant_config("fp8_e4m3"))
    with pytest.raises(ValueError, match=r"no parameter '0.bias' where the rollout copy's layer has a bias"):
        sync_weights(nn.Sequential(nn.Linear(64, 8, bias=False)), rollout)


def test_kv_scales_are_amax_over_448_per_request_and_head_over_the_unmasked_positions():
    from aisrl.quant import kv_scales

    x = torch.zeros(2, 2, 3, 4)  # (B, H, S, D)
    x[0, 0, 0, 1], x[0, 1, 2, 3] = 448.0, -44.8  # request 0: head 0 amax 448, head 1 amax 44.8
    x[1, 0, 1, 0], x[1, 0, 2, 0] = 4.48, 896.0  # request 1: 896 at a padded position
    x[1, 1, 1, 2] = 2.24
    mask = torch.tensor([[True, True, True], [True, True, False]])  # request 1's last position is padding
    s = kv_scales(x, mask)
    assert s.shape == (2, 2, 1, 1)
    torch.testing.assert_close(s.flatten(), torch.tensor([1.0, 0.1, 0.01, 0.005]))  # 448/448, 44.8/448, 4.48/448, ...
    assert kv_scales(x)[1, 0].item() == 2.0  # without the mask the padding's 896 sets the scale
    assert kv_scales(x, mask, margin=2.0)[0, 0].item() == 2.0  # the margin widens the range
