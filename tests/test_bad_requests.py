"""Bad requests stop with one message that names the field."""

import pytest

from dflash.errors import InvalidRequestError
from dflash.params import SamplingParams
from tiny import VOCAB, engine_for, tiny_drafter, tiny_target


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(seed=-1), "seed"),
        (dict(block_size=0), "block_size"),
        (dict(draft_confidence=1.5), "draft_confidence"),
        (dict(stop=("",)), "stop"),
        (dict(stop_token_ids=(-3,)), "stop_token_ids"),
        (dict(extra={"temprature": 1}), "temprature"),
    ],
)
def test_nonsense_sampling_parameters(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and field in str(err.value)


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3", max_positions=64)
    return target, tiny_drafter(target, block_size=8)


def test_prompt_problems(models):
    target, drafter = models
    engine = engine_for(target, drafter)
    with pytest.raises(InvalidRequestError, match="prompt: is empty"):
        engine.start([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.start([1, VOCAB + 5], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context holds 64"):
        engine.start([1] * 64, SamplingParams())


def test_block_size_problems(models):
    target, drafter = models
    with pytest.raises(InvalidRequestError, match="trained block size 8"):
        engine_for(target, drafter).start([1, 2], SamplingParams(block_size=16))
    with pytest.raises(InvalidRequestError, match="needs a drafter"):
        engine_for(target).start([1, 2], SamplingParams(block_size=4))


def test_stop_strings_need_a_tokenizer(models):
    target, drafter = models
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        engine_for(target, drafter).start([1, 2], SamplingParams(stop=("x",)))


def test_a_failed_request_does_not_disturb_the_next(models):
    target, drafter = models
    engine = engine_for(target, drafter)
    expected = engine_for(target).run([3, 4, 5], SamplingParams(max_new_tokens=10, ignore_eos=True)).token_ids
    with pytest.raises(InvalidRequestError):
        engine.run([], SamplingParams())
    assert engine.run([3, 4, 5], SamplingParams(max_new_tokens=10, ignore_eos=True)).token_ids == expected
