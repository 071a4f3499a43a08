"""Alternative AIS mixing formulas, scored by the estimator benchmark on identical batches.

Each maps the per-batch diagnostics (rho = sequence ESS/N, S = k3 KL per token, Gamma = E[wbar^2]/E[wbar]^2,
n = number of sequences, t = number of valid tokens), as (K,) float64 tensors, to alpha. docs/ais.md
reports what each measured.
"""

import torch

from aisrl.ais import SEVERITY_EPS, ais_alpha


def _mse_form(bias2: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """bias2 / (bias2 + var), bias2 = 2S in every variant: 0 where S <= SEVERITY_EPS, as in ais_alpha."""
    return torch.where(bias2 > 2 * SEVERITY_EPS, bias2 / (bias2 + var).clamp(min=1e-300), torch.zeros_like(bias2))


VARIANTS = {
    "design": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho * n).clamp(min=1)),
    "per_sample": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / rho.clamp(min=1e-6)),
    "sqrt_n": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho * n.sqrt()).clamp(min=1e-6)),
    "no_rho": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / n.clamp(min=1)),
    "sqrt_no_rho": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / n.clamp(min=1).sqrt()),
    "sqrt_rho": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho.sqrt() * n).clamp(min=1)),
    "adopted": lambda rho, s, g, n, t: ais_alpha(rho, s, g, n, t),  # aisrl.ais.ais_alpha: sequence-level severity
    # c4 is the first adopted formula, (S / 2) / (S / 2 + (g - 1) / (rho n)): per-token severity
    "c4": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho * n / 4).clamp(min=1e-6)),
    "c8": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho * n / 8).clamp(min=1e-6)),
    "c16": lambda rho, s, g, n, t: _mse_form(2 * s, (g - 1) / (rho * n / 16).clamp(min=1e-6)),
    "half": lambda rho, s, g, n, t: torch.full_like(s, 0.5),
    "zero": lambda rho, s, g, n, t: torch.zeros_like(s),
    "one": lambda rho, s, g, n, t: torch.ones_like(s),
}
