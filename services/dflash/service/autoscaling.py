"""Drafter autoscaling: replicas report their drafting load; a Serve policy turns it into a replica count.

The verifier calls drafter replicas over its own gRPC connections, not through Serve handles, so
Serve's request counts never see drafter traffic and its default policy has nothing to scale on.
Instead each drafter replica returns, from `record_autoscaling_stats`:

- `inflight_drafts`: Draft calls on the replica now, running or waiting for the model;
- `hot_sessions`: sessions whose draft cache the replica holds (reported, not scaled on).

Serve aggregates each over `look_back_period_s` per replica (`aggregation_function`, mean by
default) and calls `DraftLoadPolicy`, which asks for enough replicas that each carries
`target_inflight_drafts`. Serve then treats that number as it treats its own policy's:
upscaling_factor / downscaling_factor, upscale_delay_s / downscale_delay_s, min and max replicas.

Serve pickles this module by value into its controller, so it imports nothing from dflash.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

INFLIGHT_DRAFTS = "inflight_drafts"
HOT_SESSIONS = "hot_sessions"
POLICY_FUNCTION = "dflash.service.autoscaling:DraftLoadPolicy"


class DraftLoadPolicy:
    """A Serve autoscaling policy; Serve builds it once with `policy_kwargs` and calls it every tick."""

    def __init__(self, target_inflight_drafts: float = 2.0) -> None:
        number = isinstance(target_inflight_drafts, (int, float)) and not isinstance(target_inflight_drafts, bool)
        if not (number and target_inflight_drafts > 0):
            raise ValueError(f"target_inflight_drafts: must be a number > 0, got {target_inflight_drafts!r}")
        self.target_inflight_drafts = float(target_inflight_drafts)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        """(desired replicas, policy state): the fleet's in-flight drafts over the per-replica target,
        within the context's min and max. Until a replica has reported, the current target stands."""
        load = (ctx.aggregated_metrics or {}).get(INFLIGHT_DRAFTS)
        if not load:
            return ctx.target_num_replicas, {}
        desired = sum(load.values()) / self.target_inflight_drafts
        return min(max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas), {}
