"""The target's embedding and LM head read alone from its checkpoint, against the full model's own."""

import json
import logging

import pytest
import torch
from dflash.drafter.local import LocalDrafter
from dflash.errors import CheckpointError
from dflash.loading import load_target
from dflash.target import TargetModel
from dflash.target_heads import load_target_heads
from safetensors.torch import load_file, save_file
from tiny import prompts, tiny_drafter, tiny_target

CPU = torch.device("cpu")


def saved_target(tmp_path, family="qwen3", tied=False, **save):
    model = tiny_target(family, tie_word_embeddings=tied)
    model.save_pretrained(tmp_path, **save)
    return model


def full_heads(directory):
    model, _ = load_target(directory, CPU, torch.float32)
    return model, model.get_input_embeddings(), model.get_output_embeddings()


def drafts(model, embed, lm_head, draft_model, prompt, rounds=3):
    """Draft blocks over the target's real features, one round after another."""
    target = TargetModel(model, draft_model.config.target_layer_ids)
    drafter = LocalDrafter(draft_model, embed, lm_head)
    out = target.forward_alone(prompt)
    blocks, start = [], 0
    for _ in range(rounds):
        block = drafter.draft("s", out.features[start:], start, prompt[-1], draft_model.config.block_size)
        blocks.append(block.tolist())
        start = out.features.shape[0]
        prompt = prompt + block[:2].tolist()
        out = target.forward_alone(prompt)
    return blocks


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_heads_equal_the_full_models_and_draft_the_same(tmp_path, family, tied, caplog):
    saved_target(tmp_path, family, tied)
    with caplog.at_level(logging.WARNING, logger="dflash.target_heads"):
        heads = load_target_heads(tmp_path, CPU, "auto")
    assert not caplog.records, "a safetensors checkpoint must not fall back to the full model"
    model, embed, lm_head = full_heads(tmp_path)
    assert type(heads.embed_tokens) is torch.nn.Embedding and type(heads.lm_head) is torch.nn.Linear
    assert heads.embed_tokens.weight.dtype == torch.float32 and heads.embed_tokens.weight.device == CPU
    assert torch.equal(heads.embed_tokens.weight, embed.weight)
    assert torch.equal(heads.lm_head.weight, lm_head.weight)
    assert (heads.lm_head.weight is heads.embed_tokens.weight) == tied
    assert heads.config.num_hidden_layers == model.config.num_hidden_layers

    draft_model = tiny_drafter(model, block_size=8)
    prompt = prompts(1, seed=3, lo=12, hi=20)[0]
    assert drafts(model, heads.embed_tokens, heads.lm_head, draft_model, prompt) == \
        drafts(model, embed, lm_head, draft_model, prompt)


def test_sharded_checkpoint(tmp_path):
    saved_target(tmp_path, "llama", max_shard_size="20KB")
    shards = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) > 2 and shards["model.embed_tokens.weight"] != shards["lm_head.weight"]
    heads = load_target_heads(tmp_path, CPU, torch.bfloat16)
    _, embed, lm_head = full_heads(tmp_path)
    assert heads.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(heads.embed_tokens.weight, embed.weight.to(torch.bfloat16))
    assert torch.equal(heads.lm_head.weight, lm_head.weight.to(torch.bfloat16))


def test_missing_embedding_names_the_file_and_tensor(tmp_path):
    saved_target(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    del state["model.embed_tokens.weight"]
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: has no tensor 'model\.embed_tokens\.weight'"):
        load_target_heads(tmp_path, CPU, "auto")


def test_misshapen_head_is_an_error(tmp_path):
    saved_target(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["lm_head.weight"] = state["lm_head.weight"][:10].contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError,
                       match=r"'lm_head\.weight' .* has shape \(10, 32\), config\.json implies \(64, 32\)"):
        load_target_heads(tmp_path, CPU, "auto")


def test_a_checkpoint_that_is_not_safetensors_loads_the_full_model_and_says_why(tmp_path, caplog):
    model = saved_target(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with caplog.at_level(logging.WARNING, logger="dflash.target_heads"):
        heads = load_target_heads(tmp_path, CPU, torch.float32)
    assert "not a safetensors checkpoint" in caplog.text
    assert torch.equal(heads.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(heads.lm_head.weight, model.get_output_embeddings().weight)


def test_a_scaled_embedding_loads_the_full_model_and_says_why(tmp_path, caplog):
    """Gemma's embedding multiplies by sqrt(hidden): a plain nn.Embedding of its weight would be wrong."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               intermediate_size=64)).eval()
    model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash.target_heads"):
        heads = load_target_heads(tmp_path, CPU, torch.float32)
    assert "Gemma3TextScaledWordEmbedding, not a plain nn.Embedding" in caplog.text
    ids = torch.arange(10)
    assert torch.equal(heads.embed_tokens(ids), model.get_input_embeddings()(ids))
