"""`dflash train` end to end: load the target, (regenerate responses), tokenize, (cache features),
build a fresh drafter config, train, and leave a drafter in the public format in out_dir."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..drafter.checkpoint import check_compatible, load_drafter
from ..drafter.config import DFlashConfig, default_target_layer_ids
from ..errors import DFlashError
from ..loading import load_target, resolve_device, resolve_dtype
from .config import TrainConfig
from .data import eval_prompt_ids, load_samples
from .features import CachedFeatures, OnlineFeatures, cache_features
from .regenerate import regenerate
from .state import STATE_FILE
from .trainer import Trainer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def train(config: TrainConfig) -> Path:
    """Run the whole recipe; returns out_dir (holding config.json + model.safetensors)."""
    device = resolve_device(config.device)
    model, tokenizer = load_target(config.target, device, resolve_dtype("auto", device))
    if tokenizer is None:
        raise DFlashError(f"target '{config.target}' has no tokenizer files; training needs its tokenizer")
    out_dir = Path(config.out_dir)
    if not config.resume and (out_dir / "checkpoint" / STATE_FILE).is_file():
        raise DFlashError(f"'{out_dir}' holds a training checkpoint; pass --resume to continue it "
                          "or choose a new --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    if not config.resume:
        (out_dir / "train_log.jsonl").unlink(missing_ok=True)  # a fresh run starts a fresh log
    data = config.data
    if config.regenerate:
        data = regenerate(model, tokenizer, config.data, out_dir / "regenerated.jsonl",
                          max_new_tokens=config.regen_max_new_tokens, temperature=config.regen_temperature,
                          batch_size=config.regen_batch_size, seed=config.seed,
                          max_prompt_tokens=config.max_length - config.block_size)
    samples, skipped = load_samples(data, tokenizer, config.max_length)
    if skipped:
        print(f"dflash train: skipped {skipped} records with fewer than 2 response tokens")
    drafter_config = drafter_config_for(config, model, tokenizer)
    init_weights = None
    if config.init_drafter is not None and not config.resume:
        init_weights = initial_weights(config.init_drafter, drafter_config,
                                       new_layer_ids=config.target_layer_ids is not None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    layer_ids = drafter_config.target_layer_ids
    if config.offline_features:
        cache_dir = cache_features(model, samples, out_dir / "features", layer_ids,
                                   with_last_hidden=config.needs_last_hidden, batch_size=config.batch_size,
                                   pad_id=pad_id)
        features = CachedFeatures(cache_dir, device)
    else:
        features = OnlineFeatures(model, layer_ids, with_last_hidden=config.needs_last_hidden)
    eval_prompts = []
    if config.eval_prompts is not None:
        eval_prompts = eval_prompt_ids(config.eval_prompts, tokenizer, config.max_length)
    trainer = Trainer(config, model, drafter_config, samples, features, tokenizer=tokenizer,
                      eval_prompts=eval_prompts, pad_id=pad_id, init_weights=init_weights)
    if config.resume:
        trainer.resume()
    return trainer.fit()


def drafter_config_for(config: TrainConfig, model: PreTrainedModel,
                       tokenizer: PreTrainedTokenizerBase) -> DFlashConfig:
    """The new drafter's config, checked against the target (layer ids, mask token)."""
    text = model.config.get_text_config()
    mask_token_id = config.mask_token_id
    if mask_token_id is None:
        mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if mask_token_id is None:
            raise DFlashError(
                "the target's tokenizer has no mask token; pass --mask-token-id with a token id the target "
                "never produces (e.g. a reserved special token) or add a mask token to its tokenizer"
            )
    layer_ids = config.target_layer_ids
    if layer_ids is None:
        # The paper spreads n layers over 1 .. L-3; a shallow target has only L-3 distinct layers there.
        num = config.num_features or min(5, max(1, text.num_hidden_layers - 3))
        layer_ids = default_target_layer_ids(text.num_hidden_layers, num)
    if len(set(layer_ids)) != len(layer_ids):
        raise DFlashError(f"target layer ids {list(layer_ids)} repeat a layer; pass fewer --num-features "
                          "or explicit --target-layer-ids")
    bad = [i for i in layer_ids if i >= text.num_hidden_layers]
    if bad:
        raise DFlashError(f"--target-layer-ids {bad} do not exist in a {text.num_hidden_layers}-layer target")
    drafter_config = DFlashConfig.for_target(
        model.config, num_layers=config.num_layers, block_size=config.block_size,
        mask_token_id=mask_token_id, target_layer_ids=list(layer_ids),
    )
    check_compatible(drafter_config, model.config, model.get_input_embeddings().weight.shape[0])
    return drafter_config


def initial_weights(directory: str, drafter_config: DFlashConfig, *,
                    new_layer_ids: bool = False) -> dict[str, torch.Tensor]:
    """The float32 weights of the drafter in `directory`, which must have the shape the flags build.

    With `new_layer_ids` (ids given explicitly) the drafter may have read other target layers, as many as
    these: its weights keep their shapes and training re-learns what the feature projection means.
    With more --num-layers than it has, it grows: the new layers go on top as copies of its last layer
    whose output projections (o_proj, down_proj) are zero, so the grown drafter starts out drafting
    exactly what the smaller one did."""
    start = load_drafter(directory, dtype=torch.float32)
    theirs_layers, ours_layers = start.config.num_hidden_layers, drafter_config.num_hidden_layers
    grows = ours_layers > theirs_layers
    for f in dataclasses.fields(DFlashConfig):
        if not f.compare:
            continue
        theirs, ours = getattr(start.config, f.name), getattr(drafter_config, f.name)
        if theirs == ours:
            continue
        if f.name == "target_layer_ids" and new_layer_ids and len(theirs) == len(ours):
            print(f"dflash train: --init-drafter read target layers {list(theirs)}; this run reads {list(ours)}")
            continue
        if grows and (f.name == "num_hidden_layers" or (f.name == "layer_types" and ours[:len(theirs)] == theirs)):
            continue
        raise DFlashError(f"--init-drafter '{directory}' has {f.name}={theirs!r} but these flags build "
                          f"{f.name}={ours!r}; pass matching flags (e.g. --num-layers (more layers grow it), "
                          "--target-layer-ids (other layers, as many, are allowed), --block-size)")
    weights = start.state_dict()
    if grows:
        print(f"dflash train: --init-drafter has {theirs_layers} layers; layers {theirs_layers}..{ours_layers - 1} "
              "start as copies of its last layer with zero output projections")
        top = f"layers.{theirs_layers - 1}."
        for layer in range(theirs_layers, ours_layers):
            for key in [k for k in weights if k.startswith(top)]:
                copy = weights[key].clone()
                if key.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                    copy.zero_()
                weights[f"layers.{layer}." + key[len(top):]] = copy
    return weights
