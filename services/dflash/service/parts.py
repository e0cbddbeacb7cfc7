"""Building a replica's heavy parts from the config: the verifier's engine, the drafter's sessions."""

from __future__ import annotations

import torch

from ..defaults import demo_pair
from ..drafter.checkpoint import check_compatible, load_drafter
from ..drafter.config import DFlashConfig
from ..engine import SpeculativeEngine, StepObserver
from ..loading import (
    build_engine,
    local_drafter,
    prepare_for_inference,
    resolve_device,
    resolve_drafter_dtype,
    resolve_dtype,
)
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


def build_verifier_engine(config: ServiceConfig, store: SessionStore, metrics: ServiceMetrics | None,
                          observer: StepObserver | None = None) -> SpeculativeEngine:
    """Co-located: the drafter in this process. Disaggregated: a RemoteDrafter (only the drafter's config is
    read here). Rounds are journaled to the session store, steps reported to `observer` (metrics and
    traces by default; an engine process sends them to its replica instead)."""
    target_dir, drafter_dir = model_dirs(config)

    def remote(draft_config: DFlashConfig) -> RemoteDrafter:
        return RemoteDrafter(store, draft_config.block_size, draft_config.mask_token_id,
                             draft_config.target_layer_ids, config.drafter_net, metrics)

    return build_engine(target_dir, drafter_dir, device=config.model.device, dtype=config.model.dtype,
                        drafter_dtype=config.model.drafter_dtype,
                        scheduler=config.scheduler, observer=observer or StepTelemetry(metrics), journal=store,
                        remote_drafter=remote if config.mode == "disaggregated" else None)


def build_draft_sessions(config: ServiceConfig) -> DraftSessions:
    """The drafter plus the target's embedding and LM head, read alone from the target's checkpoint."""
    target_dir, drafter_dir = model_dirs(config)
    device = resolve_device(config.model.device)
    # The heads are this replica's alone: loaded in the drafter's dtype (build_engine's rule).
    dtype = resolve_drafter_dtype(config.model.drafter_dtype, resolve_dtype(config.model.dtype, device), device)
    heads = load_target_heads(target_dir, device, dtype)
    embed = heads.embed_tokens.weight
    draft_model = prepare_for_inference(load_drafter(drafter_dir, device=device, dtype=embed.dtype))
    prepare_for_inference(heads.lm_head)
    check_compatible(draft_model.config, heads.config, embed.shape[0])
    drafter = local_drafter(draft_model, heads.embed_tokens, heads.lm_head, heads_shared=False)
    return DraftSessions(drafter, config.drafter_net.max_sessions)
