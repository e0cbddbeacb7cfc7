"""Tiny real models for tests: random-weight Qwen3 and Llama targets, DFlash drafters, a character tokenizer."""

from __future__ import annotations

import string

import torch
from dflash.drafter import DFlashConfig, DFlashDraftModel
from dflash.drafter.local import LocalDrafter
from dflash.drafter.protocol import GREEDY, Draft
from dflash.engine import SpeculativeEngine
from dflash.sampling import propose_tokens
from dflash.scheduler import SchedulerConfig
from dflash.target import TargetModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

# 62 printable characters + end-of-text + mask = a 64-token vocabulary.
CHARS = string.ascii_lowercase + string.digits + " .,;:()[]{}=+-*/<>!?'\"_#\n"
VOCAB = 64
EOS_ID = VOCAB - 2
MASK_ID = VOCAB - 1


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, so stop strings can start and end anywhere inside a block."""
    vocab = {c: i for i, c in enumerate(CHARS[: VOCAB - 2])}
    vocab["<|endoftext|>"] = EOS_ID
    vocab["<|MASK|>"] = MASK_ID
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", mask_token="<|MASK|>"
    )


def tiny_target(family: str = "qwen3", seed: int = 0, layers: int = 4, max_positions: int = 512, **config):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=max_positions, eos_token_id=EOS_ID,
        pad_token_id=EOS_ID, bos_token_id=EOS_ID, **config,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        raise ValueError(family)
    # Sharper logits make random models loop like small trained ones and keep argmax ties away.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def tiny_drafter(target_model, block_size: int = 16, num_layers: int = 2, seed: int = 1, **kw) -> DFlashDraftModel:
    torch.manual_seed(seed)
    config = DFlashConfig.for_target(
        target_model.config, num_layers=num_layers, block_size=block_size, mask_token_id=MASK_ID,
        num_features=2, **kw,
    )
    return DFlashDraftModel(config).eval()


# Tests verify every proposal unless they test the adaptive policy: round statistics stay deterministic.
FULL = SchedulerConfig(verify_policy="full")


def engine_for(target_model, drafter_model=None, tokenizer=None, eos=(), config=FULL,
               attention="auto") -> SpeculativeEngine:
    if drafter_model is None:
        return SpeculativeEngine(TargetModel(target_model, attention=attention), None, tokenizer, eos, config)
    target = TargetModel(target_model, drafter_model.config.target_layer_ids, attention=attention)
    drafter = LocalDrafter(drafter_model, target.embed_tokens, target.lm_head, attention=attention)
    return SpeculativeEngine(target, drafter, tokenizer, eos, config)


class OneSessionAtATime:
    """`Drafter.draft_batch` for test doubles that implement a one-session `draft`."""

    def draft_batch(self, requests):
        out = []
        for r in requests:
            tokens = self.draft(r.session_id, r.context, r.context_start, r.last_token, r.block_size, r.sampling)
            out.append(Draft(tokens, torch.ones(tokens.shape[0])))
        return out


class OracleDrafter(OneSessionAtATime):
    """A test double for the `Drafter` protocol that knows the continuation (a "script").

    A random drafter almost never agrees with the target, so acceptance lengths > 0 and stops
    inside accepted blocks would go untested. This drafter proposes the script's next tokens
    (the target's own output, computed by the test) and corrupts each with probability
    `error_rate`, giving every acceptance length. It also checks the protocol's bookkeeping:
    each call's context continues exactly where the previous one ended.
    """

    def __init__(self, prompt_len: int, script: list[int], block_size: int = 16, error_rate: float = 0.2,
                 seed: int = 0):
        self.prompt_len = prompt_len
        self.script = script
        self.block_size = block_size
        self.mask_token_id = MASK_ID
        self.target_layer_ids = (0,)
        self.error_rate = error_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.seen = 0

    def draft(self, session_id, context, context_start, last_token, block_size, sampling=GREEDY):
        """With sampling.min_confidence > 0 the draft is cut at a random length (>= 1), like a real drafter's cut."""
        assert context_start == self.seen, "context must continue where the previous call ended"
        self.seen = context_start + context.shape[0]
        first = self.seen + 1 - self.prompt_len  # script index of the first drafted position
        draft = (self.script[first : first + block_size - 1] + [0] * block_size)[: block_size - 1]
        bad = (torch.rand(len(draft), generator=self.rng) < self.error_rate).tolist()
        if sampling.min_confidence > 0:
            draft = draft[: int(torch.randint(1, len(draft) + 1, (1,), generator=self.rng))]
        return torch.tensor([(t + 1) % (VOCAB - 2) if b else t for t, b in zip(draft, bad)], dtype=torch.long)

    def release(self, session_id):
        pass


class TargetDistributionDrafter(OneSessionAtATime):
    """A test double whose distribution IS the target's: each proposal comes from the target's own
    logits for the committed tokens (known from `script`, the same request's target-only output) and
    its earlier proposals, picked with `propose_tokens` under the round's DraftSampling (or always its
    argmax with `argmax_only`). So a coupled pick must always be accepted, whatever the temperature.
    """

    def __init__(self, model, prompt_ids: list[int], script: list[int], block_size: int = 8, argmax_only: bool = False):
        self.model = model
        self.tokens = list(prompt_ids) + list(script)
        self.block_size = block_size
        self.mask_token_id = MASK_ID
        self.target_layer_ids = (0,)
        self.argmax_only = argmax_only

    @torch.no_grad()
    def draft(self, session_id, context, context_start, last_token, block_size, sampling=GREEDY):
        position = context_start + context.shape[0]  # where last_token sits
        ids = self.tokens[: position + 1]
        assert ids[-1] == last_token, "the committed tokens must be the target-only output's prefix"
        proposals = []
        for j in range(block_size - 1):
            logits = self.model(torch.tensor([ids])).logits[0, -1:].float()
            token, _ = propose_tokens(logits, GREEDY if self.argmax_only else sampling, position + 1 + j)
            proposals.append(int(token))
            ids.append(int(token))
        return torch.tensor(proposals, dtype=torch.long)

    def release(self, session_id):
        pass


def oracle_engine(target_model, prompt_ids, script, error_rate=0.2, tokenizer=None, eos=(), seed=0, block_size=16):
    drafter = OracleDrafter(len(prompt_ids), script, block_size, error_rate, seed)
    target = TargetModel(target_model, (0,))
    return SpeculativeEngine(target, drafter, tokenizer, eos, FULL)


def hf_greedy(model, prompt_ids, max_new_tokens, eos=None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=EOS_ID,
    )
    return out[0, len(prompt_ids):].tolist()


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 2, (k,), generator=g).tolist() for k in lengths]
