"""The ranks u of sampled tokens from a logits tensor (aurora.rl.ranks): samples of the
distribution give uniform u's (ties included), the greedy token gives u near 1, a random id u
near 0; and the Trainer's recompute gives the ranks with the log-probs it gave before."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aurora.policy.sampling import RankStats, SamplingRule, Skew, judge_ranks  # noqa: E402
from aurora.rl.ranks import rank_transform  # noqa: E402


def ks(us: np.ndarray) -> float:
    x = np.sort(us)
    k = np.arange(1, len(x) + 1)
    return float(max(np.max(k / len(x) - x), np.max(x - (k - 1) / len(x))))


def logits_and_samples(n: int, vocab: int, temperature: float, seed: int, *, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3.0
    if ties:  # a few probability levels shared by many tokens
        logits = torch.round(logits)
    p = torch.softmax(logits / temperature, dim=-1)
    tokens = torch.multinomial(p, 1, generator=g)[:, 0]
    noise = torch.rand(n, generator=g, dtype=torch.float64)
    return logits, p, tokens, noise


@pytest.mark.parametrize(("temperature", "ties"), [(1.0, False), (0.7, False), (1.0, True)])
def test_samples_of_the_sampling_distribution_give_uniform_ranks(temperature, ties):
    n = 20_000
    logits, _, tokens, noise = logits_and_samples(n, 64, temperature, 0, ties=ties)
    u = rank_transform(logits, tokens, noise, temperature).numpy()
    assert ks(u) * math.sqrt(n) < 1.95  # the KS test's 0.1% level
    stats = RankStats().add(u.tolist())
    assert abs(stats.z) < 4 and judge_ranks(stats, SamplingRule()) is None


def test_the_greedy_token_ranks_near_one_and_a_random_id_near_zero():
    n = 5000
    logits, p, _, noise = logits_and_samples(n, 64, 1.0, 1)
    top = p.max(-1).values
    greedy = rank_transform(logits, p.argmax(-1), noise, 1.0)
    # u = 1 - p_max + V p_max exactly: the greedy token is last in the order.
    assert torch.allclose(greedy, (1 - top.double()) + noise * top.double(), atol=1e-6)
    assert float(greedy.mean()) > 0.5 + 0.5 * float((1 - top).mean()) - 0.01
    assert judge_ranks(RankStats().add(greedy.tolist()), SamplingRule()) is Skew.LIKELY
    lowest = rank_transform(logits, p.argmin(-1), noise, 1.0)
    assert float(lowest.max()) < 1e-3
    # Samples at the wrong temperature are caught too: T = 0.5 samples judged at T = 1.
    sharp = torch.multinomial(torch.softmax(logits / 0.5, -1), 1)[:, 0]
    u = rank_transform(logits, sharp, noise, 1.0)
    assert judge_ranks(RankStats().add(u.tolist()), SamplingRule()) is Skew.LIKELY


def test_rank_transform_refuses_shapes_that_do_not_match():
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError):
        rank_transform(logits, torch.zeros(2, dtype=torch.long), torch.zeros(2), 1.0)
    with pytest.raises(ValueError):
        rank_transform(logits, torch.zeros(3, dtype=torch.long), torch.zeros(3), 0.0)


def test_the_trainers_recompute_gives_the_same_log_probs_with_the_ranks():
    from aurora.models import TinyQwen3Config, build_default
    from aurora.rl.tasks import ArithmeticTask
    from aurora.rl.trainer import Group, GRPOConfig, Trainer

    class Sample:
        def __init__(self, ids):
            self.token_ids, self.logprobs = ids, [0.0] * len(ids)

    torch.manual_seed(0)
    model, tok = build_default(TinyQwen3Config())
    trainer = Trainer(model, tok, ArithmeticTask().reward, GRPOConfig(lr=1e-4, temperature=0.8))
    groups = [
        Group(prompt="12+7=", completions=[Sample([5, 13, 2]), Sample([7])], version=0),
        Group(prompt="3*4=", completions=[Sample([4, 4, 6, 2])], version=0),
    ]
    noise = [[[0.5] * 3, [0.1]], [[0.9] * 4]]
    lps, ranks = trainer.recompute_ranks(groups, noise)
    assert np.allclose(
        [x for g in lps for c in g for x in c],
        [x for g in trainer.recompute_logprobs(groups) for c in g for x in c],
        atol=1e-5,
    )
    assert [[len(c) for c in g] for g in ranks] == [[3, 1], [4]]
    assert all(0 <= u <= 1 for g in ranks for c in g for u in c)
