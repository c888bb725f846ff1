"""A fixed random linear map of a model's gradient to D numbers (a CountSketch), for the gradient probes
(``tools.probe``): a 540 MB float32 gradient of SmolLM2-135M becomes 0.5 MB at D = 2^17 with its inner products kept
in expectation (Charikar, Chen & Farach-Colton 2002)."""

from __future__ import annotations

import torch
from torch import Tensor


class GradientSketch:
    """A fixed CountSketch of the gradient of ``params``: bucket i mod ``dim`` with a random sign per coordinate.

    Args:
        params: the parameters whose ``.grad`` is sketched, in a fixed order (n coordinates in all).
        dim: D, the number of buckets (>= 1).
        seed: seed of the signs (the same map for every gradient of a probe).

    ``__call__()`` returns (sketch float32 [D], exact ‖g‖² float) of the current gradients (None grads
    count as 0). Memory: n bits as a bool sign mask (135 MB for SmolLM2-135M) plus one flat copy of the
    gradient while sketching. Raises ValueError for dim < 1.
    """

    def __init__(self, params: list[torch.nn.Parameter], dim: int = 1 << 17, seed: int = 0):
        if dim < 1:
            raise ValueError(f"sketch dim must be >= 1, got {dim}")
        self.params, self.dim = list(params), int(dim)
        gen = torch.Generator().manual_seed(seed)
        self.negative = [
            torch.randint(0, 2, (p.numel(),), generator=gen, dtype=torch.uint8).bool() for p in self.params
        ]
        self.numel = sum(p.numel() for p in self.params)

    def flat(self, vectors: list[Tensor | None]) -> Tensor:
        """The signed, concatenated float32 vector of per-parameter tensors (None = zeros)."""
        parts = []
        for p, neg, v in zip(self.params, self.negative, vectors):
            x = torch.zeros(p.numel(), dtype=torch.float32) if v is None else v.detach().reshape(-1).float().cpu()
            parts.append(torch.where(neg, -x, x))
        return torch.cat(parts)

    def of(self, vectors: list[Tensor | None]) -> tuple[Tensor, float]:
        """(sketch [D] float32, exact squared norm) of one vector given per parameter."""
        flat = self.flat(vectors)
        sq = float(flat.double().pow(2).sum())
        pad = (-flat.numel()) % self.dim
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.dim).sum(0, dtype=torch.float64).float(), sq

    def __call__(self) -> tuple[Tensor, float]:
        return self.of([p.grad for p in self.params])
