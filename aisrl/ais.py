"""Adaptive Importance Sampling (AIS): the per-batch mixing coefficient alpha.

AIS (arXiv 2605.13907) multiplies each token's policy-gradient loss by the detached weight

    omega_t = (1 - alpha) + alpha * wbar_t,     wbar_t = clip(w_t, floor, cap),

so the batch gradient is exactly (1 - alpha) g_none + alpha g_tis. Alpha comes from three batch
diagnostics, each computed from all-reduced sums (`aisrl.dist`):

- weight reliability  rho   = ESS/N of the sequence weights W_i = exp(sum_t delta_it), in (0, 1];
- divergence severity S     = k3 estimate of KL(mu || pi) per token, E[w - 1 - delta] >= 0;
- variance amplification Gamma = E[wbar^2] / E[wbar]^2 >= 1 (token level, truncated weights).

The combination is the minimiser of a surrogate mean-squared error of the interpolated gradient,
MSE(alpha) ~ (1 - alpha)^2 |b|^2 + alpha^2 v / N_eff. Each sequence contributes a function of all its
tokens, so the bias of the uncorrected gradient is set by how far the *sequence* distributions differ:
Pinsker's inequality in its oscillation form, |E_mu f - E_pi f| <= osc(f) sqrt(KL_seq / 2), and the chain
rule of KL, KL_seq = sum_t E[KL_t] ~ Lbar S (Lbar = tokens per sequence), give |b|^2 ~ Lbar S / 2. The
extra variance of the truncated IS gradient is v ~ Gamma - 1, and the effective number of independent
sequences is N_eff = rho * N_seq. Since Lbar N_seq = N_tok, the number of valid tokens in the batch,

    alpha* = (Lbar S / 2) / (Lbar S / 2 + (Gamma - 1) / (rho N_seq)) = rho N_tok S / (rho N_tok S + 2 (Gamma - 1)),

clipped to [0, 1] and 0 when S <= 1e-8 (SEVERITY_EPS; no mismatch: the on-policy gradient is recovered exactly).
docs/ais.md derives it, lists the variants we measured (the first adopted formula used the per-token S
in place of Lbar S), and shows the benchmark and training numbers behind the choice (benchmarks/estimator.py,
aisrl compare). An optional EMA across steps smooths alpha: alpha_t = ema * alpha_{t-1} +
(1 - ema) * alpha_batch, with the previous value passed in by the caller (the function stays pure).
"""

from __future__ import annotations

import torch

from aisrl.diagnostics import Batch, _div, _s, k3_per_token, sequence_ess
from aisrl.dist import all_sum

SEVERITY_EPS = 1e-8
"""Severity below this is treated as no mismatch: alpha = 0, every weight exactly 1 when w == 1."""


def ais_diagnostics(b: Batch, cap: float, floor: float = 0.0) -> dict[str, torch.Tensor]:
    """The three AIS diagnostics of a prepared batch, all-reduced, as float64 scalars."""
    m = b.mask
    d = b.delta.double()
    wbar = d.exp().clamp(min=floor, max=cap)  # (N, T)
    k3 = k3_per_token(d)  # (N, T)
    n, s_k3, s_wb, s_wb2, n_seq = all_sum(
        _s(m.double()), _s(k3, m), _s(wbar, m), _s(wbar**2, m), _s(b.seq_mask.double())
    )
    mean_wb = _div(s_wb, n)
    gamma = torch.where(mean_wb > 0, _div(_div(s_wb2, n), mean_wb**2), torch.ones_like(mean_wb))
    return {
        "weight_reliability": sequence_ess(b),
        "divergence_severity": _div(s_k3, n),
        "variance_amplification": gamma.clamp(min=1.0),
        "num_seqs": n_seq,
        "num_tokens": n,
    }


def ais_alpha(
    reliability: torch.Tensor,
    severity: torch.Tensor,
    amplification: torch.Tensor,
    num_seqs: torch.Tensor,
    num_tokens: torch.Tensor,
) -> torch.Tensor:
    """Mixing coefficient in [0, 1] from the three diagnostics and the batch's sequence and valid-token
    counts (see the module docstring)."""
    n_eff = reliability * num_seqs  # rho * N_seq
    bias2 = n_eff * severity * _div(num_tokens, num_seqs)  # N_eff * Lbar * S, i.e. 2 N_eff |b|^2
    alpha = _div(bias2, bias2 + 2.0 * (amplification - 1.0).clamp(min=0.0))
    alpha = torch.where(severity > SEVERITY_EPS, alpha, torch.zeros_like(alpha))
    return alpha.clamp(0.0, 1.0)
