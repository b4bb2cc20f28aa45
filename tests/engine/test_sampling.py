"""The sampler draws from exactly the distribution whose logprobs it reports."""

from __future__ import annotations

import torch

from tidal.engine.sampling import sample_tokens


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
