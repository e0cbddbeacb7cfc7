"""Who runs in the next step: admission under the cache budget, then tokens under the step budget.

nano-vllm's shape: requests wait in a queue, are admitted while the running set and the cache have
room, and each step gives every running request that has finished its prefill one verify slot
(its last token plus up to block_size - 1 draft tokens), then spends what is left of the step's token
budget on chunks of the prompts still being prefilled, so a long prompt never stalls the streams.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import DFlashError, InvalidRequestError

if TYPE_CHECKING:  # the service's config reads SchedulerConfig and must not import torch
    from .block_manager import BlockManager
    from .generation import Generation


DEFAULT_STREAM_INTERVAL_MS = 50.0  # measured: docs/service.md#streaming
MAX_STREAM_INTERVAL_MS = 10_000


class QueueFullError(DFlashError):
    """More requests waiting than the queue holds (RESOURCE_EXHAUSTED in the service)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine (one verifier replica).

    max_running: sessions decoding at once. max_step_tokens: tokens one target forward takes (verify
    blocks + prefill chunks). max_queued: requests waiting for admission before new ones are refused.
    cache_tokens: positions the target KV cache may hold over all sessions; a session reserves
    prompt + max_new_tokens + one block of them when admitted. verify_policy: "adaptive" picks each
    session's verify length per step from the drafter's confidence and the measured cost curve;
    "full" verifies every proposal (what a batch-1 engine does). stream_interval_ms: with the step loop
    running (a server), a stream gets its first token at once, then whatever rounds are ready at most
    every this many milliseconds (checked at the end of each step; 0: every round as it is made). Fewer,
    larger messages cost the serving path less per token; a request may set its own. pipeline_drafts
    (draft_pipeline.py): "auto" makes drafting beside verification an arm of the adaptive policy when
    the drafter runs on devices of its own (remote replicas), taken where it measures better (never
    with verify_policy "full"); "on" drafts beside verification in every drafting step; "off" never.
    """

    max_running: int = 16
    max_step_tokens: int = 512
    max_queued: int = 256
    cache_tokens: int = 1 << 16
    verify_policy: str = "adaptive"
    stream_interval_ms: float = DEFAULT_STREAM_INTERVAL_MS
    pipeline_drafts: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "max_queued", "cache_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DFlashError(f"scheduler.{name}: {value!r} is not a positive integer")
        value = self.stream_interval_ms
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_STREAM_INTERVAL_MS:
            raise DFlashError(f"scheduler.stream_interval_ms: {value!r} is not a number of milliseconds in "
                              f"[0, {MAX_STREAM_INTERVAL_MS}]")
        if self.verify_policy not in ("adaptive", "full"):
            raise DFlashError(f"scheduler.verify_policy: {self.verify_policy!r} is not 'adaptive' or 'full'")
        if self.pipeline_drafts not in ("auto", "on", "off"):
            raise DFlashError(f"scheduler.pipeline_drafts: {self.pipeline_drafts!r} is not 'auto', 'on' or 'off'")


@dataclass
class StepPlan:
    """One step's work: sessions that verify a block, and prefill chunks (session, number of tokens)."""

    decodes: list[Generation] = field(default_factory=list)
    prefills: list[tuple[Generation, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    """Owns the waiting queue and the running set of one engine; not thread-safe (the engine locks)."""

    def __init__(self, config: SchedulerConfig, cache: BlockManager, block_size: int = 1) -> None:
        self.config = config
        self.cache = cache
        self.block_size = block_size
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []

    def add(self, gen: Generation, reserve_tokens: int) -> None:
        """Admit (or queue) a request that will hold up to `reserve_tokens` cache positions; QueueFullError
        when it would wait and max_queued already do."""
        if reserve_tokens > self.cache.budget_tokens:
            raise InvalidRequestError(
                "max_new_tokens", f"prompt + max_new_tokens need {reserve_tokens} cache positions; this server's "
                f"cache holds {self.cache.budget_tokens} (scheduler.cache_tokens): ask for fewer tokens")
        gen.reserved_tokens = reserve_tokens
        self.waiting.append(gen)
        self._admit()
        if len(self.waiting) > self.config.max_queued:
            self.waiting.remove(gen)
            raise QueueFullError(f"server: {self.config.max_queued} requests are already waiting "
                                 "(scheduler.max_queued); retry with backoff")

    def schedule(self) -> StepPlan:
        """Admit what fits, then plan this step's tokens."""
        self._admit()
        plan, budget = StepPlan(), self.config.max_step_tokens
        for gen in self.running:
            if not gen.prefilling and budget > 0:
                plan.decodes.append(gen)
                budget -= min(gen.block_size, budget)
        for gen in self.running:
            if gen.prefilling and budget > 0:
                chunk = min(len(gen.prefill_ids) - gen.num_cached, budget)
                plan.prefills.append((gen, chunk))
                budget -= chunk
        return plan

    def retire(self, gen: Generation) -> None:
        """Take a finished, cancelled or failed request out and free its cache."""
        if gen in self.running:
            self.running.remove(gen)
            self.cache.free(gen.request_id)
        elif gen in self.waiting:
            self.waiting.remove(gen)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running:
            gen = self.waiting[0]
            if not self.cache.can_reserve(gen.reserved_tokens):
                return  # first come, first served: later requests do not overtake a large one
            self.waiting.popleft()
            self.cache.reserve(gen.request_id, gen.reserved_tokens)
            self.running.append(gen)
