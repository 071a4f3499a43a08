"""Alternative AIS mixing formulas, scored by the estimator benchmark on identical batches.

Each maps the per-batch diagnostics (rho = sequence ESS/N, S = k3 KL, Gamma = E[wbar^2]/E[wbar]^2,
n = number of sequences), as (K,) float64 tensors, to alpha. docs/ais.md reports what each measured.
"""

import torch

from aisrl.ais import ais_alpha


def _mse_form(bias2: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    return torch.where(bias2 > 0, bias2 / (bias2 + var).clamp(min=1e-300), torch.zeros_like(bias2))


VARIANTS = {
    "design": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho * n).clamp(min=1)),
    "per_sample": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / rho.clamp(min=1e-6)),
    "sqrt_n": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho * n.sqrt()).clamp(min=1e-6)),
    "no_rho": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / n.clamp(min=1)),
    "sqrt_no_rho": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / n.clamp(min=1).sqrt()),
    "sqrt_rho": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho.sqrt() * n).clamp(min=1)),
    "adopted": lambda rho, s, g, n: ais_alpha(rho, s, g, n),  # aisrl.ais.ais_alpha (equals c4)
    "c4": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho * n / 4).clamp(min=1e-6)),
    "c8": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho * n / 8).clamp(min=1e-6)),
    "c16": lambda rho, s, g, n: _mse_form(2 * s, (g - 1) / (rho * n / 16).clamp(min=1e-6)),
    "half": lambda rho, s, g, n: torch.full_like(s, 0.5),
    "zero": lambda rho, s, g, n: torch.zeros_like(s),
    "one": lambda rho, s, g, n: torch.ones_like(s),
}
