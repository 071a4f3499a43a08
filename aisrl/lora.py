"""LoRA (peft) for the trainer, and the merged weights that the rollout copy must receive.

The rollout copy is a plain model: every step it gets W + (alpha / r) B A for each adapted layer, under the
plain model's parameter names (peft's `.base_layer` and `lora_*` bookkeeping stripped). peft is imported
lazily, so full fine-tuning needs only torch and transformers.
"""

from __future__ import annotations

import torch


def apply_lora(model, r: int, alpha: float, targets: list[str], dropout: float = 0.0, optional=()):
    """The model with LoRA adapters on the linear layers `targets` names (peft's rule: a module whose name is the
    target or ends in '.' + target). A target that names no module is an error (peft adapts the others without a
    word), except those in `optional` (the default list, written for several architectures)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        raise ImportError("lora.r > 0 needs peft: pip install peft") from e
    modules = [m for m, _ in model.named_modules()]

    def matches(t: str) -> bool:
        return any(m == t or m.endswith(f".{t}") for m in modules)

    unmatched = [t for t in targets if t not in optional and not matches(t)]
    if unmatched or not any(map(matches, targets)):  # the optional defaults alone, none in this architecture
        leaves = sorted({m.rsplit(".", 1)[-1] for m, mod in model.named_modules() if _is_linear(mod)})
        raise ValueError(f"lora.targets {unmatched or list(targets)} name no module of this model; its linear layers "
                         f"are {leaves}")  # fmt: skip
    names: dict[int, list[str]] = {}  # parameter -> every name it has (tied embeddings: two)
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for module, _ in model.named_modules():
        tied = next((n for n in names.values() if len(n) > 1 and f"{module}.weight" in n), [])
        others = sorted(set(tied) - {f"{module}.weight"})
        if others and any(module == t or module.endswith(f".{t}") for t in targets):
            raise ValueError(f"lora.targets adapts {module!r}, whose weight is tied to {others}: the adapter would "
                             "change one use of it and the rollout copy's sync would not see it; leave it out of "
                             "lora.targets")  # fmt: skip
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=dropout))


def _is_linear(module) -> bool:
    """A layer peft's LoRA adapts as a linear one: torch's Linear, or the transposed Conv1D of GPT-2-style models."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def is_peft(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


@torch.no_grad()
def merged_state(model) -> dict[str, torch.Tensor]:
    """{plain parameter name: tensor} with LoRA deltas merged in (the model's own tensors if not peft)."""
    if not is_peft(model):
        return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())  # tied names too
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out = {}
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer):
            w = mod.base_layer.weight
            for adapter in mod.active_adapters:
                w = w + mod.get_delta_weight(adapter)
            out[f"{name}.weight"] = w
    for name, t in list(base.named_parameters(remove_duplicate=False)) + list(base.named_buffers()):
        if "lora_" not in name:
            out.setdefault(name.replace(".base_layer", ""), t)
    return out
