"""The chat prompt of an open pair: messages through the target's own chat template (with its
BOS and EOS texts), as token ids."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from specrun.run.template import ChatTemplate, render_chat

if TYPE_CHECKING:
    from specrun.run.session import OpenPair


def model_template(pair: OpenPair) -> ChatTemplate:
    """The target's chat template, with its BOS and EOS token texts."""
    info = pair.target_info
    tok = info.tokens

    def text(i: int | None) -> str:
        return tok[i] if i is not None and 0 <= i < len(tok) else ""

    return ChatTemplate(info.chat_template, text(info.bos_id), text(info.eos_id))


def chat_prompt(pair: OpenPair, messages: list[dict], warn: Callable[[str], None] | None = None) -> list[int]:
    """Messages rendered with the model's template, as token ids. Templates that write the
    BOS text themselves do not get a second one from the tokenizer."""
    tmpl = model_template(pair)
    text = render_chat(tmpl, messages, warn)
    bos = tmpl.bos_token
    return pair.target.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)


def chat_text(pair: OpenPair, messages: list[dict], warn: Callable[[str], None] | None = None) -> str:
    """The same prompt as text, for a tool that tokenizes it adding the model's own specials
    (llama.cpp's do): without a BOS text the template wrote where the tokenizer adds one."""
    tmpl = model_template(pair)
    text = render_chat(tmpl, messages, warn)
    bos = tmpl.bos_token
    return text.removeprefix(bos) if bos and pair.target_info.add_bos else text
