"""Every decoding method behind one small interface: prompt token ids in, a timed `Sample` out.

Methods: our engine (target alone at block 1, DFlash at block 16 and 8, and block 16 with drafts cut
where the drafter's joint confidence falls below a threshold), transformers `generate`
(plain, assisted with an autoregressive draft model, prompt lookup, and transformers' own DFlash with
our drafter's weights converted exactly), and DFlash through the running service over gRPC. All time
the same things the same way:

- TTFT: from the call until the first new token is in hand (prefill, plus for assisted methods the
  first draft-and-verify pass).
- decode time: from the first new token to the last; decode tokens are those after the first chunk,
  so a method whose first pass already commits several tokens gets no free tokens.
- `committed`: tokens committed per decode round (bonus token included), the paper's tau counts.
- draft/verify seconds of the decode rounds (prefill excluded).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..engine import SpeculativeEngine
from ..params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..drafter.model import DFlashDraftModel


@dataclass
class Sample:
    """One prompt decoded by one method."""

    token_ids: list[int]
    ttft_s: float
    decode_s: float
    first_chunk: int  # tokens delivered with the first token (1 for plain decoding)
    committed: list[int] = field(default_factory=list)  # per decode round, bonus included
    draft_s: float | None = None  # None: the method drafts without a model (or not at all)
    verify_s: float = 0.0

    @property
    def decode_tokens(self) -> int:
        return max(len(self.token_ids) - self.first_chunk, 0)


class Method(Protocol):
    """A decoder under test. `name` is its row in the table."""

    name: str

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Sample:
        """Decode `prompt_ids` (batch 1); temperature 0 is greedy, else full-vocabulary sampling seeded by `seed`."""
        ...


# -- our engine ------------------------------------------------------------------------------------


class EngineMethod:
    """Our decode loop; block 1 is the target alone through the same code path."""

    def __init__(self, name: str, engine: SpeculativeEngine, block_size: int, draft_confidence: float = 0.0) -> None:
        self.name = name
        self.engine = engine
        self.block_size = block_size
        self.draft_confidence = draft_confidence

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Sample:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                block_size=self.block_size, draft_confidence=self.draft_confidence)
        tokens, committed, draft_ms, verify_ms, totals = [], [], 0.0, 0.0, None
        for r in self.engine.generate(prompt_ids, params):
            tokens += r.token_ids
            totals = r.totals
            if r.stats.index > 0:
                committed.append(r.stats.committed)
                draft_ms += r.stats.draft_ms
                verify_ms += r.stats.verify_ms
        return Sample(tokens, totals.ttft_s, totals.decode_s, 1, committed,
                      draft_ms / 1000 if self.block_size > 1 else None, verify_ms / 1000)


# -- transformers generate -------------------------------------------------------------------------


class _Clock:
    """A transformers streamer and forward hooks that time the call from the outside.

    The streamer sees the prompt first, then every committed chunk of tokens (one per target pass);
    the hooks time each forward of the target and of the draft model.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.chunks: list[tuple[float, int]] = []
        self.forwards: dict[str, list[tuple[float, float]]] = {"target": [], "draft": []}
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.chunks.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    def hook(self, model: torch.nn.Module, role: str) -> list[RemovableHandle]:
        started = []

        def pre(*_: object) -> None:
            started.append(time.perf_counter())

        def post(*_: object) -> None:
            self.forwards[role].append((started.pop(), time.perf_counter()))

        return [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]

    def decode_seconds(self, role: str) -> float:
        """Forward time of `role` after the first chunk arrived (decode rounds only)."""
        first = self.chunks[0][0] if self.chunks else float("inf")
        return sum(b - a for a, b in self.forwards[role] if a >= first)


class HFMethod:
    """`model.generate` with extra keyword arguments: none (plain), an assistant model, or prompt lookup."""

    def __init__(self, name: str, model: PreTrainedModel, draft_model: PreTrainedModel | None = None,
                 pad_token_id: int | None = None, **generate_kwargs: object) -> None:
        self.name = name
        self.model = model
        self.draft_model = draft_model
        self.pad_token_id = pad_token_id
        self.kwargs = generate_kwargs
        if draft_model is not None:
            self.kwargs["assistant_model"] = draft_model

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Sample:
        device = self.model.device
        ids = torch.tensor([prompt_ids], device=device)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        clock = _Clock()
        hooks = clock.hook(self.model, "target")
        if self.draft_model is not None:
            hooks += clock.hook(self.draft_model, "draft")
        try:
            torch.manual_seed(seed)
            clock.start = time.perf_counter()
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, streamer=clock,
                pad_token_id=self.pad_token_id, **sampling, **self.kwargs,
            )
        finally:
            for h in hooks:
                h.remove()
        tokens = out[0, len(prompt_ids):].tolist()
        chunks = clock.chunks
        if not chunks:
            return Sample(tokens, time.perf_counter() - clock.start, 0.0, len(tokens))
        return Sample(
            tokens,
            ttft_s=chunks[0][0] - clock.start,
            decode_s=chunks[-1][0] - chunks[0][0],
            first_chunk=chunks[0][1],
            committed=[n for _, n in chunks[1:]],
            draft_s=clock.decode_seconds("draft") if self.draft_model is not None else None,
            verify_s=clock.decode_seconds("target"),
        )


def plain_generate(model: PreTrainedModel, pad_token_id: int | None = None) -> HFMethod:
    return HFMethod("transformers generate", model, pad_token_id=pad_token_id)


def assisted_generate(model: PreTrainedModel, draft_model: PreTrainedModel, pad_token_id: int | None = None,
                      num_assistant_tokens: int | None = None) -> HFMethod:
    """Assisted generation; None keeps transformers' own schedule (what a user gets by default)."""
    extra = {} if num_assistant_tokens is None else dict(
        num_assistant_tokens=num_assistant_tokens, num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0)
    return HFMethod("transformers assisted (AR draft)", model, draft_model, pad_token_id, **extra)


def prompt_lookup(model: PreTrainedModel, pad_token_id: int | None = None, num_tokens: int = 10) -> HFMethod:
    return HFMethod("transformers prompt lookup", model, pad_token_id=pad_token_id, prompt_lookup_num_tokens=num_tokens)


TRANSFORMERS_DFLASH = "transformers DFlash (same drafter)"


def transformers_dflash(model: PreTrainedModel, drafter_model: DFlashDraftModel,
                        pad_token_id: int | None = None) -> HFMethod:
    """transformers' own DFlash loop (`speculation_type="dflash"`) on our drafter's weights, converted
    exactly (dflash.drafter.transformers_format); raises CheckpointError for a drafter it cannot run."""
    from ..drafter.transformers_format import to_transformers
    from ..loading import prepare_for_inference

    # Laid out as our drafter is (its weights are copied into a fresh transformers model), in the target's
    # dtype: transformers' loop feeds the target's hidden states to the drafter as they are, so a bf16 drafter
    # beside a float32 target (ours on an AMX CPU, loading.resolve_drafter_dtype) runs there in float32.
    converted = to_transformers(drafter_model).to(model.dtype)
    return HFMethod(TRANSFORMERS_DFLASH, model, prepare_for_inference(converted), pad_token_id,
                    speculation_type="dflash")


# -- the running service ---------------------------------------------------------------------------


class ServiceMethod:
    """DFlash through a running `dflash serve` (gRPC `Generate`, streamed); times are the client's."""

    def __init__(self, name: str, address: str, block_size: int | None = None, token: str = "",
                 timeout_s: float = 600.0) -> None:
        from .load import connect

        self.name = name
        self.client = connect(address, token)
        self.block_size = block_size
        self.timeout_s = timeout_s

    def run(self, prompt_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> Sample:
        from .load import stream_request

        record = stream_request(self.client, prompt_ids, max_new_tokens, temperature, seed, self.block_size,
                                self.timeout_s)
        if record.error:
            raise RuntimeError(f"service error: {record.error}")
        return Sample(record.token_ids, record.ttft_s, record.decode_s, record.first_chunk, record.committed,
                      record.draft_s, record.verify_s)


# -- the set under test ----------------------------------------------------------------------------


def build_methods(keys: Iterable[str], engine: SpeculativeEngine, baseline: SpeculativeEngine,
                  ar_model: PreTrainedModel | str, service: str | None, assist_tokens: int | None = None,
                  lookup_tokens: int = 10, service_token: str = "",
                  draft_confidence: float = 0.0) -> tuple[list[Method], dict[str, str]]:
    """The methods named by `keys` (see commands/bench.py), and {name: reason} for those that cannot run.

    `baseline` is the target-only engine (block 1); `ar_model` the assisted-generation draft model or a
    string saying why there is none; `service` a host:port or None (`service_token`: its bearer token);
    `draft_confidence` the dflash16c method's threshold, in (0, 1).
    """
    from ..errors import CheckpointError, DFlashError

    model = engine.target.model
    pad = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
    pad = pad if pad is not None else (min(engine.eos_token_ids) if engine.eos_token_ids else None)
    trained = engine.drafter.block_size if engine.drafter is not None else 0
    methods, unavailable = [], {}
    for key in keys:
        if key == "target":
            methods.append(EngineMethod("target only (engine, block 1)", baseline, 1))
        elif key == "hf":
            methods.append(plain_generate(model, pad))
        elif key == "assisted":
            if isinstance(ar_model, str):
                unavailable["transformers assisted (AR draft)"] = ar_model
            else:
                methods.append(assisted_generate(model, ar_model, pad, assist_tokens))
        elif key == "lookup":
            methods.append(prompt_lookup(model, pad, lookup_tokens))
        elif key in ("dflash16", "dflash8"):
            size = 16 if key == "dflash16" else 8
            name = f"DFlash block {size}"
            if trained < size:
                unavailable[name] = f"the drafter is trained for block {trained}" if trained else "no drafter loaded"
            else:
                methods.append(EngineMethod(name, engine, size))
        elif key == "dflash16c":
            name = f"DFlash block 16, draft confidence {draft_confidence:g}"
            if trained < 16:
                unavailable[name] = f"the drafter is trained for block {trained}" if trained else "no drafter loaded"
            else:
                methods.append(EngineMethod(name, engine, 16, draft_confidence))
        elif key == "hfdflash":
            drafter_model = getattr(engine.drafter, "model", None)
            if drafter_model is None:
                unavailable[TRANSFORMERS_DFLASH] = "no in-process drafter loaded"
                continue
            try:
                methods.append(transformers_dflash(model, drafter_model, pad))
            except CheckpointError as exc:  # a drafter transformers' DFlash cannot run exactly: the row says why
                unavailable[TRANSFORMERS_DFLASH] = str(exc)
        elif key == "service":
            name = "DFlash via service (gRPC)"
            if not service:
                unavailable[name] = "no service given: start `dflash serve` and pass --service HOST:PORT"
                continue
            try:
                methods.append(ServiceMethod(name, service, block_size=16, token=service_token))
            except (DFlashError, ImportError, RuntimeError) as exc:
                unavailable[name] = str(exc)
    return methods, unavailable
