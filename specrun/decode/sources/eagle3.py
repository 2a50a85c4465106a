"""An EAGLE-3 head, given as the draft file (``-d eagle3-head.gguf``), as a draft source.

It drafts as the target's own MTP heads do (``mtp.py``): the backend (``llama.Eagle3Head``)
keeps the head's cache in step with the target's, each guess is one head step, and the
posteriors, stop rule and learning are the draft model's (``model.py``). The one difference
here: the head reads the target's layer inputs at the position before the one it is fed, so it
has nothing to draft from until the target has decoded a token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specrun.decode.sources.mtp import MtpSource


class Eagle3Source(MtpSource):
    name = "eagle3"

    def begin(self, prompt: list[int], may_draft: Callable[[], bool]) -> None:
        if len(prompt) > 1:
            super().begin(prompt, may_draft)

    def _start(self, tokens: list[int]) -> tuple[np.ndarray | None, float, int]:
        if len(tokens) < 2:
            return None, 0.0, 0
        return super()._start(tokens)
