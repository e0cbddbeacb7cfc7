"""Turning target logits into tokens, identically for plain and speculative decoding.

Sampling is position-seeded: the token at absolute position t is argmax(log p_t + g_t), where
g_t is Gumbel noise drawn from a generator seeded by (seed, t) alone (the Gumbel-max trick).
The noise of a position therefore does not depend on how many tokens a round verified, so a
speculative run and a target-only run with the same seed write the same tokens, and each token
is an exact sample of the target's (temperature/top-k/top-p filtered) distribution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .params import SamplingParams

if TYPE_CHECKING:
    from .drafter.protocol import DraftSampling

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for (seed, position): splitmix64 finalizer, so neighbouring positions
    get unrelated streams (Mersenne Twister seeded with nearby integers starts out correlated)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def filter_logits(logits: torch.Tensor, params: SamplingParams | DraftSampling) -> torch.Tensor:
    """Return log-probabilities after temperature, top-k and top-p; filtered-out entries are -inf.

    logits: [N, V] float. Output: [N, V] float32. Only meaningful when temperature > 0.
    """
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.log_softmax(dim=-1)


def gumbel_noise(seed: int, position: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel(0, 1) noise of shape [vocab_size] for one absolute position, drawn on `device`.

    Drawn where the logits live, so a 150k-token vocabulary costs no host work or copy; the stream
    depends only on (seed, position, device type), so outputs are reproducible per device type.
    """
    generator = torch.Generator(device=device).manual_seed(position_seed(seed, position))
    uniform = torch.rand(vocab_size, generator=generator, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(uniform))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of tied maxima, as `argmax`): `max`'s indices, which PyTorch's CPU
    kernels find in a third of argmax's time on [16, 4096] rows."""
    return logits.max(dim=-1).indices


def sample_tokens(logits: torch.Tensor, params: SamplingParams, seed: int, first_position: int) -> torch.Tensor:
    """Pick one token per row of logits [N, V]; row i predicts absolute position first_position + i.

    Returns a LongTensor [N] on the logits' device.
    """
    if params.greedy:
        return greedy(logits)
    return _gumbel_argmax(filter_logits(logits, params), seed, first_position)


def sample_rows(logits: torch.Tensor, sessions: list[tuple[SamplingParams, int, int, int, int]]) -> list[list[int]]:
    """`sample_tokens` for many sessions' rows of one packed forward's logits [K, V], with one
    device->host copy: sessions[i] = (params, seed, first_position, first_row, num_rows). Greedy rows
    take one argmax for all; a sampled session draws its own position-seeded noise (bit-identical to
    `sample_tokens` on its rows alone)."""
    if not sessions:
        return []
    picks = greedy(logits)
    sampled = [s for s in sessions if not s[0].greedy]
    if sampled:
        picks = picks.clone()
        for params, seed, first, row, n in sampled:
            picks[row : row + n] = sample_tokens(logits[row : row + n], params, seed, first)
    host = picks.tolist()
    return [host[row : row + n] for _, _, _, row, n in sessions]


def propose_tokens(
    logits: torch.Tensor, rule: DraftSampling, first_position: int, with_probs: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafter's side of `sample_tokens`: proposals for rows of the drafter's logits [N, V], row i
    for absolute position first_position + i, picked as `rule` says (see DraftSampling).

    Given the target's own logits, this returns exactly the tokens `sample_tokens` draws. Returns
    (tokens [N], with_probs: the drafter's probability of each token under its filtered distribution).
    """
    if rule.greedy:
        if not with_probs:
            return greedy(logits), None
        top, tokens = logits.max(dim=-1)
        # The top token's softmax probability, 1 / sum(exp(logit - top)). Terms below e^-80 are clamped
        # there: they are far below float32's rounding of the sum, and computed as they are, exp gives
        # denormals, which x86 computes about 25x slower (a drafter's peaked [15, 4096] logits: 1 ms
        # a round, 6% of a lone stream's round).
        shifted = (logits.float() - top.float().unsqueeze(-1)).clamp_(min=-80.0)
        return tokens, shifted.exp_().sum(dim=-1).reciprocal_()
    logprobs = filter_logits(logits, rule)
    tokens = _gumbel_argmax(logprobs, rule.seed, first_position)
    probs = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).exp() if with_probs else None
    return tokens, probs


def _gumbel_argmax(logprobs: torch.Tensor, seed: int, first_position: int) -> torch.Tensor:
    vocab, device = logprobs.shape[-1], logprobs.device
    noise = torch.stack([gumbel_noise(seed, first_position + i, vocab, device) for i in range(logprobs.shape[0])])
    return (logprobs + noise).argmax(dim=-1)
