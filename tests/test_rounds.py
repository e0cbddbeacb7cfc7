"""The pure pieces of a round: block construction, acceptance, commit, stops, sampling, text stream."""

import pytest
import torch
from dflash.errors import InvalidRequestError
from dflash.params import SamplingParams
from dflash.rounds import accept_length, committed_tokens, confident_length, cut_at_stop, make_block
from dflash.sampling import filter_logits, gumbel_noise, sample_tokens
from dflash.textstream import TextStream
from tiny import char_tokenizer


def test_make_block_is_last_token_then_masks():
    assert make_block(7, 4, 99).tolist() == [7, 99, 99, 99]
    assert make_block(7, 1, 99).tolist() == [7]


@pytest.mark.parametrize(
    "draft, posterior, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3),  # all accepted: bonus is the 4th
        ([1, 2, 3], [1, 9, 3, 4], 1),  # a later match after a mismatch does not count
        ([1, 2, 3], [5, 2, 3, 4], 0),
        ([], [5], 0),  # block size 1: nothing to accept
    ],
)
def test_accept_length(draft, posterior, expected):
    assert accept_length(torch.tensor(draft, dtype=torch.long), torch.tensor(posterior)) == expected


def test_confident_length_keeps_the_jointly_confident_prefix():
    probs = torch.tensor([0.9, 0.8, 0.5, 0.99, 0.2])  # running product 0.9, 0.72, 0.36, 0.356, 0.071
    assert confident_length(probs, 0.0) == 5
    assert confident_length(probs, 0.07) == 5
    assert confident_length(probs, 0.3) == 4
    assert confident_length(probs, 0.5) == 2
    assert confident_length(probs, 0.95) == 1  # never empty: the round still drafts one token
    assert confident_length(torch.tensor([]), 0.5) == 0
    # a later confident token does not bring back a cut draft
    assert confident_length(torch.tensor([0.9, 0.1, 1.0]), 0.5) == 1


@pytest.mark.parametrize("value", [-0.1, 1.0, float("nan"), True])
def test_draft_confidence_is_validated(value):
    with pytest.raises(InvalidRequestError, match="draft_confidence"):
        SamplingParams(draft_confidence=value)


def test_committed_tokens_are_accepted_drafts_plus_bonus():
    draft, posterior = torch.tensor([1, 2, 3]), torch.tensor([1, 9, 3, 4])
    assert committed_tokens(draft, posterior, 1) == [1, 9]
    assert committed_tokens(draft, torch.tensor([1, 2, 3, 4]), 3) == [1, 2, 3, 4]
    assert committed_tokens(torch.tensor([], dtype=torch.long), torch.tensor([5]), 0) == [5]


def test_cut_at_stop_keeps_the_stop_token_and_drops_the_rest():
    cut = cut_at_stop([4, 5, 6, 7], frozenset({6}), budget=10)
    assert cut.tokens == [4, 5, 6] and cut.finish_reason == "stop"


def test_cut_at_stop_honours_the_budget_exactly():
    assert cut_at_stop([4, 5, 6, 7], frozenset(), budget=2).tokens == [4, 5]
    assert cut_at_stop([4, 5, 6, 7], frozenset(), budget=2).finish_reason == "length"
    assert cut_at_stop([4, 5], frozenset(), budget=2).finish_reason == "length"
    assert cut_at_stop([4, 5], frozenset(), budget=3).finish_reason is None
    # A stop token beyond the budget is never reached.
    assert cut_at_stop([4, 5, 6], frozenset({6}), budget=2) .finish_reason == "length"


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).exp()
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).exp()
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.81)).exp()
    assert (p[0, :3] > 0).all() and p[0, 3] == 0
    # The most likely token always survives, however small top_p is.
    p = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.01)).exp()
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_sampling_noise_depends_only_on_seed_and_position():
    assert torch.equal(gumbel_noise(3, 10, 50), gumbel_noise(3, 10, 50))
    assert not torch.equal(gumbel_noise(3, 10, 50), gumbel_noise(3, 11, 50))
    assert not torch.equal(gumbel_noise(3, 10, 50), gumbel_noise(4, 10, 50))
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=0.7)
    together = sample_tokens(logits, params, seed=1, first_position=20)
    one_by_one = [int(sample_tokens(logits[i : i + 1], params, seed=1, first_position=20 + i)) for i in range(5)]
    assert together.tolist() == one_by_one


def test_greedy_sampling_is_argmax():
    logits = torch.randn(4, 10)
    assert torch.equal(sample_tokens(logits, SamplingParams(), 0, 0), logits.argmax(-1))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_text_stream_holds_back_a_possible_stop_prefix():
    tok = char_tokenizer()
    stream = TextStream(tok, stop=("end",))
    assert stream.push(_ids(tok, "abc e")).text == "abc "  # "e" may start "end"
    assert stream.push(_ids(tok, "x")).text == "ex"
    delta = stream.push(_ids(tok, "y en"))
    assert delta.text == "y " and delta.stop_at_token is None
    delta = stream.push(_ids(tok, "d and more"))
    assert delta.text == "" and delta.stop_at_token == len("abc exy end")
    assert stream.text == "abc exy "


def test_text_stream_stop_inside_one_push_keeps_tokens_up_to_the_stop():
    tok = char_tokenizer()
    stream = TextStream(tok, stop=("::", "zz"))
    delta = stream.push(_ids(tok, "ab::cd zz"))
    assert delta.text == "ab" and delta.stop_at_token == 4
    assert stream.flush().text == ""
