"""The DFlash decode loop: prefill, draft, verify, accept, commit, trim caches.

One request at a time reads like the paper. Each round is split into `propose` (drafter),
`verify` (target forward) and `commit` (pure acceptance plus cache trimming) so that a scheduler
can later verify the blocks of several requests in one batched forward.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch

from .drafter.protocol import Drafter
from .errors import DFlashError, InvalidRequestError
from .generation import Generation, RoundOutput
from .params import SamplingParams
from .rounds import accept_length, committed_tokens, cut_at_stop
from .sampling import sample_tokens
from .stats import GenerationStats, RoundStats
from .target import TargetModel
from .textstream import TextStream


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats


class SpeculativeEngine:
    """Lossless speculative decoding of a target with a DFlash drafter (or none: block size 1)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        tokenizer=None,
        eos_token_ids: Iterable[int] = (),
    ):
        self.target = target
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    # -- the loop ---------------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        committed_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> Iterator[RoundOutput]:
        """Stream rounds: the prefill round (first token), then one per draft-and-verify round."""
        gen = self.start(prompt_ids, params, request_id, committed_ids, seed)
        try:
            yield self.prefill(gen)
            while not gen.finished:
                yield self.step(gen)
        finally:
            self.release(gen)

    def prefill(self, gen: Generation) -> RoundOutput:
        """Run the prompt through the target and sample the first token.

        A resumed request (output_ids already committed) re-prefills prompt + committed tokens but
        the last, samples nothing, and yields an empty round: its caches are rebuilt, its text not.
        """
        t0 = time.perf_counter()
        resumed = bool(gen.output_ids)
        seq = gen.prompt_ids + gen.output_ids[:-1]
        out = self.target.forward(seq, 0, gen.cache, last_only=True)
        if gen.block_size > 1:
            gen.pending_features = out.features
        if resumed:
            return RoundOutput([], "", RoundStats(0, 0, 0, 0, 0, 0.0, self._ms_since(t0)), gen.stats, None)
        first = sample_tokens(out.logits[-1:], gen.params, gen.seed, len(gen.prompt_ids))
        verify_ms = self._ms_since(t0)
        return self._emit(gen, [int(first.item())], RoundStats(0, 0, 0, 1, 0, 0.0, verify_ms))

    def step(self, gen: Generation) -> RoundOutput:
        """One round: draft a block, verify it in one target forward, commit the agreed prefix + bonus."""
        size = self._round_block_size(gen)
        t0 = time.perf_counter()
        draft = self.propose(gen, size)
        t1 = time.perf_counter()
        draft_ms = (t1 - t0) * 1000
        out = self.target.forward([gen.last_token] + draft.tolist(), gen.position, gen.cache)
        posterior = sample_tokens(out.logits, gen.params, gen.seed, gen.position + 1).cpu()
        accepted = accept_length(draft, posterior)
        new_tokens = committed_tokens(draft, posterior, accepted)
        self.commit(gen, accepted, out.features)
        stats = RoundStats(gen.num_rounds + 1, len(draft), accepted, accepted + 1, 0, draft_ms, self._ms_since(t1))
        return self._emit(gen, new_tokens, stats)

    def propose(self, gen: Generation, size: int) -> torch.Tensor:
        """Draft tokens [at most size - 1] on the CPU (the confidence cut may keep fewer); empty when
        drafting is off for this round.

        The drafter always fills the block it was trained on (as far as the context window allows)
        and the round keeps the first size - 1 proposals: a smaller block size shortens what the
        target verifies, not the block the drafter sees, because a block of another length (fewer
        mask slots to attend to) is one it never saw in training.
        """
        if size == 1:
            return torch.empty(0, dtype=torch.long)
        room = self.target.max_positions - 1 - gen.position
        drafted = max(size, min(self.drafter.block_size, room))
        context = gen.pending_features
        draft = self.drafter.draft(gen.request_id, context, gen.drafter_start, gen.last_token, drafted,
                                   gen.draft_sampling)
        gen.drafter_start += context.shape[0]
        gen.pending_features = None
        return draft[: size - 1].to("cpu", torch.long)

    def commit(self, gen: Generation, accepted: int, features: torch.Tensor) -> None:
        """Keep the target cache up to the last accepted block token; queue its features for the drafter."""
        self.target.crop(gen.cache, gen.position + accepted + 1)
        if gen.block_size > 1:
            kept = features[: accepted + 1]
            pending = gen.pending_features
            gen.pending_features = kept if pending is None else torch.cat([pending, kept])

    def release(self, gen: Generation) -> None:
        gen.cache = None
        gen.pending_features = None
        if self.drafter is not None and gen.block_size > 1:
            self.drafter.release(gen.request_id)

    # -- requests ---------------------------------------------------------------------------------

    def start(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        committed_ids: list[int] | None = None,
        seed: int | None = None,
    ) -> Generation:
        """Validate a request and build its state; raises InvalidRequestError naming the bad field.

        To resume a request whose caches were lost, pass the tokens it already committed and the seed
        it used: generation continues exactly where it stopped (nothing repeated, nothing lost).
        """
        prompt_ids = self._check_prompt(prompt_ids)
        block_size = self._check_block_size(params)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; pass stop_token_ids instead")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        gen = Generation(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            params=params,
            block_size=block_size,
            stop_token_ids=stops,
            cache=self.target.new_cache(),
            text=TextStream(self.tokenizer, params.stop) if self.tokenizer is not None else None,
        )
        if seed is not None or params.seed is not None:
            gen.seed = seed if seed is not None else params.seed
        gen.stats.prompt_tokens = len(prompt_ids)
        if committed_ids:
            if len(committed_ids) >= params.max_new_tokens:
                raise InvalidRequestError("committed_ids", "the request already has all its tokens")
            gen.output_ids = [int(t) for t in committed_ids]
            if gen.text is not None:
                gen.text.push(gen.output_ids)
                gen.text.emitted = len(gen.text.text)  # already streamed before the interruption
        return gen

    def run(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """Generate to the end and collect the stream."""
        rounds = list(self.generate(prompt_ids, params))
        tokens = [t for r in rounds for t in r.token_ids]
        text = "".join(r.text for r in rounds)
        return GenerationResult(tokens, text, rounds[-1].finish_reason, rounds[-1].totals)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise DFlashError("this engine has no tokenizer; pass token ids")
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    # -- bookkeeping ------------------------------------------------------------------------------

    def _emit(self, gen: Generation, new_tokens: list[int], stats: RoundStats) -> RoundOutput:
        cut = cut_at_stop(new_tokens, gen.stop_token_ids, gen.remaining)
        tokens, reason, text = cut.tokens, cut.finish_reason, ""
        if gen.text is not None:
            delta = gen.text.push(tokens)
            if delta.stop_at_token is not None:
                tokens, reason = tokens[: delta.stop_at_token - len(gen.output_ids)], "stop"
            text = delta.text
        gen.output_ids.extend(tokens)
        if reason is None and gen.position + 1 >= self.target.max_positions:
            reason = "length"
        now = time.perf_counter()
        if gen.first_token_at is None:
            gen.first_token_at = now
            gen.stats.ttft_s = now - gen.started
        if reason is not None:
            gen.finish_reason = reason
            if gen.text is not None:
                text += gen.text.flush().text
        stats = replace(stats, emitted=len(tokens))
        gen.num_rounds = stats.index
        gen.stats.add_round(stats)
        gen.stats.generated_tokens = len(gen.output_ids)
        gen.stats.decode_s = now - gen.first_token_at
        return RoundOutput(tokens, text, stats, gen.stats, reason)

    def _round_block_size(self, gen: Generation) -> int:
        room = self.target.max_positions - 1 - gen.position
        return max(1, min(gen.block_size, gen.remaining, room))

    def _check_prompt(self, prompt_ids) -> list[int]:
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise InvalidRequestError("prompt", "is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
        if len(ids) >= self.target.max_positions:
            raise InvalidRequestError(
                "prompt",
                f"is {len(ids)} tokens; the model's context holds {self.target.max_positions} "
                "(prompt plus at least one new token): shorten the prompt",
            )
        return ids

    def _check_block_size(self, params: SamplingParams) -> int:
        if self.drafter is None:
            if params.block_size not in (None, 1):
                raise InvalidRequestError("block_size", f"{params.block_size} needs a drafter; none is loaded (use 1)")
            return 1
        size = params.block_size or self.drafter.block_size
        if size > self.drafter.block_size:
            raise InvalidRequestError(
                "block_size", f"{size} exceeds the drafter's trained block size {self.drafter.block_size}"
            )
        return size

    def _ms_since(self, t0: float) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000
