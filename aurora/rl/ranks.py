"""The randomized probability integral transform of sampled tokens (the statistic of
:mod:`aurora.policy.sampling`), computed from the logits of a recompute.

Theory of operation
-------------------
At one position, ``p = softmax(logits / T)`` is the distribution the job samples from (the
engines apply the temperature and nothing else: no top-p, no top-k; :mod:`aurora.engines.base`).
Order the vocabulary by increasing probability, ties by increasing id, and let ``F(t-)`` be the
probability of the tokens before ``t`` in that order. The sampled token ``t`` gets

    u = F(t-) + V * p(t)            V ~ U(0, 1), drawn by the Trainer

If ``t`` was drawn from ``p``, ``u`` is exactly U(0, 1) whatever ``p`` is (the randomized PIT of
a discrete variable; the order is total, so ties do not matter); a token likelier than a sample
would be (greedy, a chosen answer, the best of N) lands near 1, an unlikely one near 0.
"""

from __future__ import annotations

import torch

ROWS = 64
"""Positions transformed at once (bounds the float64 [positions, vocabulary] temporaries:
64 x 151,936 x 8 B = 78 MB)."""


def rank_transform(
    logits: torch.Tensor, tokens: torch.Tensor, noise: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``u`` (float64, in [0, 1]) of ``tokens[i]`` under ``softmax(logits[i] / temperature)``
    with ``noise[i]`` as V (module docstring). ``logits``: [N, V]; ``tokens``, ``noise``: [N].

    The sum runs in float64 (a Qwen3 vocabulary has 151,936 probabilities; float32 would lose
    ~1e-6 of ``u``, harmless, but float64 costs little: the tiny model has 17)."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1] or noise.shape != tokens.shape:
        raise ValueError(
            f"rank_transform: logits [N, V], tokens [N], noise [N]; got {tuple(logits.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(noise.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"rank_transform: temperature must be > 0, got {temperature!r}")
    out = torch.empty(tokens.shape, dtype=torch.float64, device=logits.device)
    ids = torch.arange(logits.shape[1], device=logits.device)
    for lo in range(0, logits.shape[0], ROWS):
        hi = min(lo + ROWS, logits.shape[0])
        p = torch.softmax(logits[lo:hi].double() / temperature, dim=-1)
        t = tokens[lo:hi].to(logits.device).long()[:, None]
        pt = p.gather(1, t)
        before = (p < pt) | ((p == pt) & (ids[None, :] < t))
        below = (p * before).sum(-1)
        v = noise[lo:hi].to(device=logits.device, dtype=torch.float64)
        out[lo:hi] = (below + v * pt[:, 0]).clamp(0.0, 1.0)
    return out
