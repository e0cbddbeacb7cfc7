"""Building a replica's heavy parts from the config: the verifier's engine, the drafter's sessions."""

from __future__ import annotations

import torch

from ..defaults import demo_pair
from ..drafter.checkpoint import check_compatible, load_config, load_drafter, resolve_dir
from ..drafter.local import LocalDrafter
from ..engine import SpeculativeEngine
from ..loading import eos_ids, load_target, resolve_device, resolve_dtype
from ..target import TargetModel
from ..target_heads import load_target_heads
from .config import ServiceConfig
from .drafter_client import RemoteDrafter
from .drafter_server import DraftSessions
from .metrics import ServiceMetrics
from .session_store import SessionStore
from .step_telemetry import StepTelemetry


def model_dirs(config: ServiceConfig) -> tuple[str, str | None]:
    if config.model.target is None:
        target, drafter = demo_pair()
        return str(target), str(config.model.drafter or drafter)
    return config.model.target, config.model.drafter


def set_threads(config: ServiceConfig) -> None:
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)


def build_verifier_engine(config: ServiceConfig, store: SessionStore, metrics: ServiceMetrics) -> SpeculativeEngine:
    """Co-located: the drafter in this process. Disaggregated: a RemoteDrafter (only the drafter's config is read)."""
    target_dir, drafter_dir = model_dirs(config)
    device = resolve_device(config.model.device)
    model, tokenizer = load_target(target_dir, device, resolve_dtype(config.model.dtype, device))
    if drafter_dir is None:
        return SpeculativeEngine(TargetModel(model), None, tokenizer, eos_ids(model), config.scheduler,
                                 observer=StepTelemetry(metrics), journal=store)
    if config.mode == "colocated":
        draft_model = load_drafter(drafter_dir, device=device, dtype=model.dtype)
        draft_config = draft_model.config
    else:
        draft_config = load_config(resolve_dir(drafter_dir, "drafter"))
    check_compatible(draft_config, model.config, model.get_input_embeddings().weight.shape[0])
    target = TargetModel(model, draft_config.target_layer_ids)
    if config.mode == "colocated":
        drafter = LocalDrafter(draft_model, target.embed_tokens, target.lm_head)
    else:
        drafter = RemoteDrafter(store, draft_config.block_size, draft_config.mask_token_id,
                                draft_config.target_layer_ids, config.drafter_net, metrics)
    return SpeculativeEngine(target, drafter, tokenizer, eos_ids(model), config.scheduler,
                             observer=StepTelemetry(metrics), journal=store)


def build_draft_sessions(config: ServiceConfig) -> DraftSessions:
    """The drafter plus the target's embedding and LM head, read alone from the target's checkpoint."""
    target_dir, drafter_dir = model_dirs(config)
    device = resolve_device(config.model.device)
    heads = load_target_heads(target_dir, device, resolve_dtype(config.model.dtype, device))
    embed = heads.embed_tokens.weight
    draft_model = load_drafter(drafter_dir, device=device, dtype=embed.dtype)
    check_compatible(draft_model.config, heads.config, embed.shape[0])
    drafter = LocalDrafter(draft_model, heads.embed_tokens, heads.lm_head)
    return DraftSessions(drafter, config.drafter_net.max_sessions)
