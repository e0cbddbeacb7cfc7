"""Drafters in the public DFlash checkpoint format: round trip, hand-written files, and bad checkpoints."""

import json

import pytest
import torch
from dflash.drafter.checkpoint import check_compatible, load_drafter, save_drafter
from dflash.errors import CheckpointError, IncompatibleDrafterError
from dflash.loading import build_engine
from dflash.params import SamplingParams
from safetensors.torch import save_file
from tiny import MASK_ID, VOCAB, char_tokenizer, engine_for, prompts, tiny_drafter, tiny_target

H, KV, HEADS, HEAD_DIM, FFN = 32, 2, 4, 8, 64


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def test_saved_and_loaded_drafter_gives_identical_drafts(target, tmp_path):
    drafter = tiny_drafter(target, block_size=8)
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    assert loaded.config == drafter.config
    a, b = engine_for(target, drafter), engine_for(target, loaded)
    for p in prompts(3):
        assert (a.run(p, SamplingParams(max_new_tokens=20)).token_ids
                == b.run(p, SamplingParams(max_new_tokens=20)).token_ids)


def test_saved_files_follow_the_public_format(target, tmp_path):
    save_drafter(tiny_drafter(target, num_layers=5), tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 16 and config["num_target_layers"] == 4
    assert set(config["dflash_config"]) == {"target_layer_ids", "mask_token_id"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert len(names) == 58  # the count the reference gives for a 5-layer drafter
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)


def hand_written_checkpoint(directory, layer_ids=(1, 2), **overrides):
    """A drafter written by hand from the documented config keys and tensor names, no project code."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM, "intermediate_size": FFN,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "block_size": 4, "num_target_layers": 4,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": MASK_ID},
    }
    config.update(overrides)
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    n = len(layer_ids)
    tensors = {
        "layers.0.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, H),
        "layers.0.self_attn.k_proj.weight": w(KV * HEAD_DIM, H),
        "layers.0.self_attn.v_proj.weight": w(KV * HEAD_DIM, H),
        "layers.0.self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        "layers.0.self_attn.q_norm.weight": torch.ones(HEAD_DIM),
        "layers.0.self_attn.k_norm.weight": torch.ones(HEAD_DIM),
        "layers.0.mlp.gate_proj.weight": w(FFN, H),
        "layers.0.mlp.up_proj.weight": w(FFN, H),
        "layers.0.mlp.down_proj.weight": w(H, FFN),
        "layers.0.input_layernorm.weight": torch.ones(H),
        "layers.0.post_attention_layernorm.weight": torch.ones(H),
        "fc.weight": w(H, n * H),
        "hidden_norm.weight": torch.ones(H),
        "norm.weight": torch.ones(H),
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def save_target(model, directory):
    model.save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    return directory


def test_hand_written_checkpoint_loads_without_renaming(target, tmp_path):
    drafter = load_drafter(hand_written_checkpoint(tmp_path / "d"))
    assert drafter.config.target_layer_ids == (1, 2) and drafter.config.block_size == 4
    engine = build_engine(save_target(target, tmp_path / "t"), tmp_path / "d", device="cpu", dtype="float32")
    alone = build_engine(tmp_path / "t", None, device="cpu", dtype="float32")
    for p in prompts(3):
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        assert engine.run(p, params).token_ids == alone.run(p, params).token_ids


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 64, "head_dim": 16}, "hidden_size"),
        ({"num_target_layers": 36}, "num_target_layers"),
        ({"vocab_size": 151936}, "vocab_size"),
    ],
)
def test_drafter_that_does_not_fit_the_target_is_refused(target, tmp_path, overrides, message):
    from dflash.drafter.checkpoint import load_config

    config = load_config(hand_written_checkpoint(tmp_path / "d", **overrides))
    with pytest.raises(IncompatibleDrafterError, match=message):
        check_compatible(config, target.config, VOCAB)


def test_layer_ids_beyond_the_target_are_refused(target, tmp_path):
    hand_written_checkpoint(tmp_path / "d", layer_ids=(1, 7), num_target_layers=8)
    from dflash.drafter.checkpoint import load_config

    with pytest.raises(IncompatibleDrafterError, match="num_target_layers|target_layer_ids"):
        check_compatible(load_config(tmp_path / "d"), target.config, VOCAB)
    hand_written_checkpoint(tmp_path / "e", layer_ids=(1, 9))
    with pytest.raises(CheckpointError, match=r"target_layer_ids \[9\]"):
        load_drafter(tmp_path / "e")


def test_mask_token_outside_the_embedding_is_refused(target, tmp_path):
    from dflash.drafter.checkpoint import load_config

    config = load_config(hand_written_checkpoint(tmp_path / "d",
                                                 dflash_config={"target_layer_ids": [1], "mask_token_id": 999}))
    with pytest.raises(IncompatibleDrafterError, match="mask_token_id 999"):
        check_compatible(config, target.config, VOCAB)


def test_missing_corrupt_and_misnamed_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_drafter(tmp_path / "nowhere")
    d = hand_written_checkpoint(tmp_path / "d")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_drafter(d)
    d = hand_written_checkpoint(tmp_path / "e")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(d)
    d = hand_written_checkpoint(tmp_path / "f")
    from safetensors.torch import load_file

    renamed = {f"model.{k}": v for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(renamed, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing: \\['fc.weight'"):
        load_drafter(d)
    d = hand_written_checkpoint(tmp_path / "g")
    config = json.loads((d / "config.json").read_text())
    del config["dflash_config"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="dflash_config"):
        load_drafter(d)


def test_wrong_shape_is_named(tmp_path):
    d = hand_written_checkpoint(tmp_path / "d", intermediate_size=32)
    with pytest.raises(CheckpointError, match="layers.0.mlp.gate_proj.weight has shape"):
        load_drafter(d)


def test_unknown_target_architecture_is_a_clear_error(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["NoSuchLM"]}))
    with pytest.raises(CheckpointError, match="cannot load target"):
        build_engine(d, None, device="cpu")


def test_hub_id_that_cannot_be_fetched_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="could not be downloaded"):
        load_drafter("z-lab/Qwen3-8B-DFlash-b16")
