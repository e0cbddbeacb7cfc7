"""Bad requests stop with one message that names the field."""

import pytest
from dflash.api.v1 import generate_pb2
from dflash.errors import InvalidRequestError
from dflash.params import SamplingParams
from dflash.service.config import ConfigError, ServiceConfig
from dflash.service.ingress import Ingress, Rejected
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


# --- edge values of the sampling parameters: each gives the limit it tends to -------------------------

@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 1e-20, 1e-6])
def test_a_tiny_temperature_decodes_greedily(models, temperature):
    """Dividing logits by 1e-40 overflowed float32: the output was token 0 at every position. The
    limit of sampling as the temperature falls to 0 is greedy decoding, and that is what it gives."""
    target, drafter = models
    engine = engine_for(target, drafter)
    greedy = engine.run([3, 4, 5], SamplingParams(max_new_tokens=12, ignore_eos=True))
    tiny = engine.run([3, 4, 5], SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=temperature, seed=1))
    assert tiny.token_ids == greedy.token_ids and tiny.finish_reason == "length"
    assert SamplingParams(temperature=temperature).greedy


def test_sampling_edge_values_on_large_logits():
    """Logits of a real model's size (|logit| up to ~60): every edge value of temperature, top_k and
    top_p samples a real token, and the one its limit says."""
    import torch
    from dflash.sampling import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 20
    argmax = logits.argmax(dim=-1)

    def sample(**kw):
        return sample_tokens(logits, SamplingParams(seed=7, **kw), seed=7, first_position=10)

    for kw in (dict(temperature=1e-40), dict(temperature=1e-30), dict(temperature=1.0, top_k=1),
               dict(temperature=1.0, top_p=1e-45), dict(temperature=3e38, top_k=1)):
        assert torch.equal(sample(**kw), argmax), kw
    # top_k at or beyond the vocabulary and top_p just below 1 filter nothing (on these logits)
    assert torch.equal(sample(temperature=1.0, top_k=1 << 31), sample(temperature=1.0))
    assert torch.equal(sample(temperature=1.0, top_k=1000), sample(temperature=1.0))
    # the uniform limit of a huge temperature: the noise alone picks, whatever the logits
    uniform = sample_tokens(torch.zeros(6, 1000), SamplingParams(temperature=1.0, seed=7), seed=7, first_position=10)
    assert torch.equal(sample(temperature=1e300), uniform) and torch.equal(sample(temperature=3e38), uniform)


def test_draft_sampling_refuses_a_temperature_it_cannot_divide_by():
    from dflash.drafter.protocol import DraftSampling
    from dflash.errors import DFlashError

    with pytest.raises(DFlashError, match=r"temperature: 1e-40 is not 0 \(greedy\) or in \[1e-05, inf\)"):
        DraftSampling(temperature=1e-40)
    for bad in (dict(top_p=float("nan"), temperature=1.0), dict(min_confidence=float("nan"))):
        with pytest.raises(DFlashError):
            DraftSampling(**bad)
    assert DraftSampling.for_request(SamplingParams(temperature=1e-40, top_p=0.5), seed=3).greedy


# --- what fits the context, and the whole range of the seed ------------------------------------------

def test_max_new_tokens_beyond_the_context_is_refused_naming_the_room(models):
    """Was: cut silently to what fits, finish "length". Now refused as vLLM and the OpenAI API refuse it,
    with the context, the prompt and the most that fits."""
    target, drafter = models
    engine = engine_for(target, drafter)
    with pytest.raises(InvalidRequestError) as err:
        engine.start([1] * 60, SamplingParams(max_new_tokens=5))
    assert err.value.field == "max_new_tokens"
    assert "context holds 64 tokens" in str(err.value) and "the prompt is 60" in str(err.value)
    assert "at most 4 new tokens" in str(err.value)
    fits = engine.run([1] * 60, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(fits.token_ids) == 4 and fits.finish_reason == "length"


def test_unset_max_new_tokens_fills_the_room_the_context_leaves(models):
    """Unset, max_new_tokens is 128 or the room left, whichever is fewer (vLLM's default): never refused."""
    from dflash.params import DEFAULT_MAX_NEW_TOKENS

    target, drafter = models
    engine = engine_for(target, drafter)
    near_the_end = engine.run([1] * 60, SamplingParams(ignore_eos=True))
    assert len(near_the_end.token_ids) == 4 and near_the_end.finish_reason == "length"
    assert engine.start([1, 2], SamplingParams()).params.max_new_tokens == 62
    big = engine_for(tiny_target("qwen3", max_positions=512))
    assert big.start([1, 2], SamplingParams()).params.max_new_tokens == DEFAULT_MAX_NEW_TOKENS == 128


def test_seeds_take_the_whole_uint64_range(models):
    """The proto's seed is uint64: every value is accepted and samples (was: >= 2**63 refused)."""
    from dflash.params import MAX_SEED

    assert MAX_SEED == (1 << 64) - 1
    with pytest.raises(InvalidRequestError, match=f"seed: must be between 0 and {MAX_SEED}, got {1 << 64}"):
        SamplingParams(seed=1 << 64)
    target, drafter = models
    speculative, plain = engine_for(target, drafter), engine_for(target)
    outputs = []
    for seed in (1 << 63, MAX_SEED):
        params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
        got = speculative.run([3, 4, 5], params).token_ids
        assert got == plain.run([3, 4, 5], params).token_ids  # still lossless: the same noise per position
        outputs.append(got)
    assert outputs[0] != outputs[1]


def test_position_seeds_below_2_63_are_unchanged():
    """Seeds < 2**63 sample exactly as before the range grew: the generator seeds are pinned."""
    from dflash.sampling import position_seed

    assert position_seed(0, 0) == 4685109482889842056
    assert position_seed(7, 10) == 1529707127375883190
    assert position_seed((1 << 63) - 1, 5) == 3303731114903442824
    assert position_seed((1 << 64) - 1, 5) == 4445859051449755722 and position_seed(1 << 63, 0) < 1 << 63


# --- prompt size, refused at the edge before the verifier tokenizes it -------------------------------

def test_a_prompt_over_max_prompt_chars_is_refused_at_the_ingress():
    """Was: a 900 KB prompt passed the 1 MiB byte limit and the verifier spent 2.3 s tokenizing it before
    refusing it. The ingress (no tokenizer) now counts its characters first and names the limit in force."""
    ingress = Ingress(ServiceConfig())
    assert ServiceConfig().limits.max_prompt_chars == 262144
    huge = generate_pb2.GenerateRequest(prompt="x" * 900_000)
    assert huge.ByteSize() < ServiceConfig().limits.max_request_bytes  # the byte limit alone let it through
    with pytest.raises(Rejected) as err:
        ingress.admit(huge, {})
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.message == ("prompt: 900000 characters exceeds limits.max_prompt_chars (262144); "
                                 "shorten the prompt")

    small = Ingress(ServiceConfig.from_dict({"limits": {"max_prompt_chars": 10}}))
    admitted = small.admit(generate_pb2.GenerateRequest(prompt="é" * 10), {})  # 20 bytes: characters count
    assert admitted.prompt_text == "é" * 10
    with pytest.raises(Rejected, match=r"^prompt: 11 characters exceeds limits.max_prompt_chars \(10\)"):
        small.admit(generate_pb2.GenerateRequest(prompt="é" * 11), {})


def test_max_prompt_chars_must_be_positive():
    with pytest.raises(ConfigError, match=r"^limits.max_prompt_chars: "):
        ServiceConfig.from_dict({"limits": {"max_prompt_chars": 0}})
