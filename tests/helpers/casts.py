"""What the weight-cast tests share: autocast entered as Lightning's ``bf16-mixed`` enters it, and the number of
casts one pass over a model should make."""

import torch


def lightning_autocast():
    """bf16 autocast as Lightning's ``bf16-mixed`` enters it: no cast cache."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def linear_weights(model) -> int:
    """Distinct weight and bias tensors of ``model``'s linear layers (a tied output layer counts once)."""
    seen = {
        id(t) for m in model.modules() if isinstance(m, torch.nn.Linear) for t in (m.weight, m.bias) if t is not None
    }
    return len(seen)
