"""Our drafter in transformers' own DFlash (`speculation_type="dflash"`) and back, on tiny Qwen3 and Llama
targets: the same draft logits, the target's greedy output, identical weights after a round trip, and
conversions that would not be exact refused by the field's name.

Tolerance: draft logits agree to 1e-4 absolute in float32 (observed ~2e-6: the same maths summed in a
different order, e.g. transformers projects [context | block] keys in one matmul, we in two).
"""

import pytest
import torch
from dflash.cli import main
from dflash.drafter import DFlashConfig, DFlashDraftModel
from dflash.drafter.checkpoint import load_drafter, save_drafter
from dflash.drafter.local import LocalDrafter
from dflash.drafter.protocol import DraftRequest
from dflash.drafter.transformers_format import dflash_config, from_transformers, to_transformers, transformers_config
from dflash.errors import CheckpointError
from dflash.params import SamplingParams
from dflash.target import TargetModel
from tiny import EOS_ID, MASK_ID, engine_for, hf_greedy, prompts, tiny_drafter, tiny_target
from transformers import AutoModel

ATOL = 1e-4
NEW_TOKENS = 40


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP's waiting makes them 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def drafter_with(target, block_size=8, **raw_overrides) -> DFlashDraftModel:
    """A tiny random drafter whose config.json carries `raw_overrides` (layer types, RoPE scaling, ...)."""
    base = DFlashConfig.for_target(target.config, num_layers=2, block_size=block_size, mask_token_id=MASK_ID,
                                   num_features=2, target_layer_ids=[1, 2])
    torch.manual_seed(1)
    return DFlashDraftModel(DFlashConfig.from_dict({**base.raw, **raw_overrides})).eval()


def dflash_generate(target, assistant, prompt_ids, record=None) -> list[int]:
    """transformers' DFlash greedy; `record` collects (position_ids, last_hidden_state) of every draft."""
    hook = None
    if record is not None:
        hook = assistant.register_forward_hook(
            lambda m, a, kw, out: record.append((kw["position_ids"].clone(), out.last_hidden_state.clone())),
            with_kwargs=True)
    ids = torch.tensor([prompt_ids])
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              assistant_model=assistant, speculation_type="dflash", pad_token_id=EOS_ID)
    finally:
        if hook is not None:
            hook.remove()
    return out[0, len(prompt_ids):].tolist()


class RecordingHead(torch.nn.Module):
    """The target's LM head, keeping what it returns (our drafter's logits)."""

    def __init__(self, head):
        super().__init__()
        self.head, self.weight, self.outputs = head, head.weight, []

    def forward(self, x):
        self.outputs.append(self.head(x))
        return self.outputs[-1]


def our_first_round_logits(target, drafter, prompt_ids, first_token) -> torch.Tensor:
    """Our in-process drafter's logits for the first round: prompt features as context, block after it."""
    t = TargetModel(target, drafter.config.target_layer_ids)
    head = RecordingHead(t.lm_head)
    local = LocalDrafter(drafter, t.embed_tokens, head)
    context = t.forward_alone(prompt_ids).features
    local.draft_batch([DraftRequest("s", context, 0, first_token, drafter.config.block_size)])
    return head.outputs[0]


def every_round_matches(target, drafter, seq, record) -> float:
    """Max |logit difference| between each transformers draft and ours recomputed from the same context."""
    features = TargetModel(target, drafter.config.target_layer_ids).forward_alone(seq).features
    block, worst = drafter.config.block_size, 0.0
    with torch.no_grad():
        for positions, hidden in record:
            start = int(positions[0, -block])  # the block's first position: the last committed token
            ids = torch.tensor([seq[start]] + [MASK_ID] * (block - 1))
            ours = drafter(target.get_input_embeddings()(ids)[None], features[:start][None],
                           torch.arange(start + block)[None])
            worst = max(worst, (target.lm_head(ours) - target.lm_head(hidden)).abs().max().item())
    return worst


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_exported_drafter_drafts_the_same_logits_and_keeps_greedy_output(family, tmp_path):
    target = tiny_target(family)
    drafter = tiny_drafter(target, block_size=8)
    save_drafter(drafter, tmp_path / "ours")
    assert main(["export", "--format", "transformers", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    assistant = AutoModel.from_pretrained(tmp_path / "hf").eval()
    assert type(assistant).__name__ == "MuseGlimmerAssistantModel"
    engine = engine_for(target, drafter)
    for prompt in prompts(2, seed=4):
        record = []
        tokens = dflash_generate(target, assistant, prompt, record)
        assert tokens == hf_greedy(target, prompt, NEW_TOKENS)  # lossless in transformers too
        assert tokens == engine.run(prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)).token_ids
        theirs = target.lm_head(record[0][1][0, 1:])  # what DFlashTokenCandidateGenerator proposes from
        ours = our_first_round_logits(target, drafter, prompt, tokens[0])
        assert ours.shape == theirs.shape == (7, target.config.vocab_size)
        assert (ours - theirs).abs().max().item() <= ATOL
        assert every_round_matches(target, drafter, prompt + tokens, record) <= ATOL


def test_sliding_window_converts_with_the_window_shifted_by_one(tmp_path):
    """Ours: q - k < W. transformers: |q - k| <= W'. Equal for W' = W - 1 when W >= block_size."""
    target = tiny_target("qwen3")
    drafter = drafter_with(target, block_size=8, layer_types=["sliding_attention", "full_attention"],
                           sliding_window=10)
    assistant = to_transformers(drafter)
    assert assistant.config.sliding_window == 9 and assistant.config.layer_types[0] == "sliding_attention"
    prompt = prompts(1, seed=5, lo=30, hi=31)[0]  # context well past the window
    record = []
    tokens = dflash_generate(target, assistant, prompt, record)
    assert tokens == hf_greedy(target, prompt, NEW_TOKENS)
    assert every_round_matches(target, drafter, prompt + tokens, record) <= ATOL
    back = from_transformers(assistant)
    assert back.config == drafter.config


@pytest.mark.parametrize("overrides", [
    {},
    {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}},
])
def test_round_trip_export_import_gives_identical_weights(overrides, tmp_path):
    target = tiny_target("llama")
    drafter = drafter_with(target, **overrides).to(torch.bfloat16)
    save_drafter(drafter, tmp_path / "ours")
    assert main(["export", "--format", "transformers", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    assert main(["export", "--format", "dflash", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    a, b = load_drafter(tmp_path / "ours"), load_drafter(tmp_path / "back")
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype == torch.bfloat16 for k in sa)


def test_import_of_a_checkpoint_without_our_extra_keys_needs_the_target(tmp_path, capsys):
    target = tiny_target("qwen3")
    target.save_pretrained(tmp_path / "target")
    assistant = to_transformers(tiny_drafter(target, block_size=8))
    for key in ("num_target_layers", "vocab_size"):
        delattr(assistant.config, key)
    assistant.save_pretrained(tmp_path / "hf")
    assert main(["export", "--format", "dflash", str(tmp_path / "hf"), str(tmp_path / "a")]) == 2
    assert "num_target_layers" in capsys.readouterr().err
    assert main(["export", "--format", "dflash", str(tmp_path / "hf"), str(tmp_path / "b"),
                 "--target", str(tmp_path / "target")]) == 0
    assert load_drafter(tmp_path / "b").config.num_target_layers == 4
    assert main(["export", "--format", "dflash", str(tmp_path / "hf"), str(tmp_path / "b")]) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.parametrize("overrides, field", [
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 7}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
])
def test_export_refuses_what_transformers_would_run_differently(overrides, field, tmp_path, capsys):
    drafter = drafter_with(tiny_target("qwen3"), block_size=8, **overrides)
    with pytest.raises(CheckpointError, match=field):
        transformers_config(drafter.config)
    save_drafter(drafter, tmp_path / "ours")
    assert main(["export", "--format", "transformers", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 2
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("change, field", [
    (lambda c: c.pop("target_layer_ids"), "target_layer_ids"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.update(sliding_window=6, layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
    (lambda c: c.pop("layer_types"), "sliding_window"),  # transformers' default: every layer slides, window 2048
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (lambda c: c.update(model_type="qwen3"), "model_type"),
])
def test_import_refuses_what_our_drafter_would_run_differently(change, field):
    raw = transformers_config(drafter_with(tiny_target("qwen3"), block_size=8).config).to_dict()
    change(raw)
    if field == "sliding_window" and "layer_types" not in raw:
        raw["block_size"] = 4096  # 2048 < block_size - 1: refused; with a real block it would convert
    with pytest.raises(CheckpointError, match=field):
        dflash_config(raw)
