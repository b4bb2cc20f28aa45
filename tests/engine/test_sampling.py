"""The sampler draws from exactly the distribution whose logprobs it reports."""

from __future__ import annotations

import torch

from tidal.engine.sampling import inverse_cdf, sample_tokens


def test_empirical_frequencies_match_probabilities() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logprobs = probs.log().expand(4000, -1).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    draws = sample_tokens(logprobs, torch.zeros(4000, dtype=torch.bool), gens)
    freq = torch.bincount(draws, minlength=6).double() / 4000
    assert freq[1] == 0 and freq[5] == 0  # zero-mass tokens are never drawn
    # 4 standard errors of a binomial proportion at n = 4000
    bound = 4 * (probs * (1 - probs) / 4000).sqrt() + 1e-9
    assert torch.all((freq - probs.double()).abs() <= bound)


def test_same_generator_state_same_draw_and_greedy_rows() -> None:
    logprobs = torch.randn(3, 151_665).log_softmax(-1)
    a = sample_tokens(logprobs, torch.tensor([False, True, False]),
                      [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    b = sample_tokens(logprobs, torch.tensor([False, True, False]),
                      [torch.Generator().manual_seed(s) for s in (1, 2, 3)])
    assert torch.equal(a, b)
    assert a[1] == logprobs[1].argmax()


def _sequential(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The inverse CDF over one float64 running sum of the whole vocabulary (the sampler
    before its two levels): the oracle."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    return torch.searchsorted(cdf, q * cdf[:, -1:]).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def test_two_level_inverse_cdf_draws_what_one_running_sum_draws() -> None:
    g = torch.Generator().manual_seed(0)
    for vocab, scale in ((49_152, 3.0), (151_665, 1.0), (1000, 8.0), (2048 + 7, 12.0)):
        logits = torch.randn(512, vocab, generator=g) * scale
        # top-p style holes: tokens of zero mass between and around the kept ones
        logits[::3] = logits[::3].masked_fill(torch.rand(logits[::3].shape, generator=g) < 0.9,
                                              float("-inf"))
        logits[1::7, : vocab // 2] = float("-inf")  # a row's first blocks all without mass
        probs = logits.log_softmax(-1).exp()
        q = 1.0 - torch.rand(512, 1, dtype=torch.float64, generator=g)
        q[:4] = 1.0  # the very end of the distribution
        drawn = inverse_cdf(probs, q)
        assert torch.equal(drawn, _sequential(probs, q)), vocab
        assert bool((probs.gather(-1, drawn[:, None]) > 0).all())  # never a zero-mass token


def test_all_greedy_rows_take_the_argmax() -> None:
    logprobs = torch.randn(5, 3000).log_softmax(-1)
    gens = [torch.Generator().manual_seed(s) for s in range(5)]
    assert torch.equal(sample_tokens(logprobs, torch.ones(5, dtype=torch.bool), gens),
                       logprobs.argmax(-1))
    for s, gen in enumerate(gens):  # each row's generator moved on one draw, as a sampled one's
        ref = torch.Generator().manual_seed(s)
        torch.empty(1, dtype=torch.float64).uniform_(generator=ref)
        assert torch.equal(gen.get_state(), ref.get_state())
