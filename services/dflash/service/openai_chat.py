"""The target's chat template at the ingress: chat messages in, prompt token ids out.

Loaded with transformers' PreTrainedTokenizerFast, which (unlike AutoTokenizer) imports no torch: the
ingress runs on CPU-only proxy nodes. The ingress needs the target's tokenizer files (tokenizer.json,
tokenizer_config.json or chat_template.jinja), not its weights. A target without a template, or whose
tokenizer cannot be loaded here, answers chat requests with a 400 that says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..defaults import DEMO_TARGET

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("dflash.service")


class NoChatTemplate(Exception):
    """This target cannot render chat messages; the message says why."""


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerFast | None, unavailable: str = "") -> None:
        self.tokenizer = tokenizer
        self.unavailable = unavailable or ("" if tokenizer is None or tokenizer.chat_template else
                                           "the model's tokenizer has no chat template")

    @classmethod
    def load(cls, target: str | None) -> ChatTemplate:
        """The template of the target directory or hub id (None: the demo target); never raises."""
        from transformers import PreTrainedTokenizerFast

        path = str(target or DEMO_TARGET)
        try:
            return cls(PreTrainedTokenizerFast.from_pretrained(path))
        except Exception as exc:  # a chat request says why; completions need no tokenizer here
            log.warning("chat completions are off: cannot load the tokenizer of %s (%s)", path, exc)
            return cls(None, f"the ingress could not load the model's tokenizer ({type(exc).__name__})")

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The token ids of `messages` ({role, content}) rendered with the generation prompt appended;
        NoChatTemplate when there is no template or it refuses the messages."""
        if self.unavailable:
            raise NoChatTemplate(f"{self.unavailable}; send the prompt to /v1/completions instead")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # templates raise for what they refuse (roles out of order, ...)
            raise NoChatTemplate(f"the model's chat template refused them: {exc}") from None
        # The template writes the special tokens itself (as vLLM encodes a rendered chat).
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
