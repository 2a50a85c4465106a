"""A chat session: history, the model's template, and the KV cache kept between turns.

Each turn re-renders the whole conversation with the template and hands it to the engine,
whose prefill reuses the longest common prefix with what the target's cache already holds, so
a turn evaluates only its own new tokens (``RunStats.n_prompt_tokens`` shows how many). The
earlier turns keep the tokens they had (the replies as generated, not re-tokenized: a reply
need not tokenize back to the tokens it was generated as), so that prefix is the whole past.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from specrun.decode.engine import Engine
from specrun.decode.stats import RunStats
from specrun.errors import InputError, SpecrunError
from specrun.run.stream import Event, stream_generate
from specrun.run.template import ChatTemplate, render_chat


@dataclass
class Turn:
    user: str
    reply: str
    stats: RunStats


@dataclass
class ChatSession:
    engine: Engine
    template: ChatTemplate
    system: str | None = None
    warn: object = None  # callable(str), for template fallbacks
    add_special: bool = True
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    totals: RunStats = field(default_factory=RunStats)
    # the last turn's prompt and reply as the engine saw them, as tokens and as text
    past_tokens: list[int] = field(default_factory=list, repr=False)
    past_text: str = field(default="", repr=False)

    def _conversation(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + self.messages

    def prompt_tokens(self) -> list[int]:
        return self._prompt()[1]

    def _prompt(self) -> tuple[str, list[int]]:
        text = render_chat(self.template, self._conversation(), self.warn)
        target = self.engine.target
        if self.past_tokens and text.startswith(self.past_text):
            # the conversation so far is unchanged: keep its tokens, tokenize only the new text
            return text, self.past_tokens + target.tokenize(text[len(self.past_text) :], add_special=False, parse_special=True)
        bos = self.template.bos_token
        add = self.add_special and not (bos and text.startswith(bos))
        return text, target.tokenize(text, add_special=add, parse_special=True)

    def send(self, user_text: str, max_tokens: int, stop: threading.Event | None = None) -> Iterator[Event]:
        """Stream the reply to ``user_text``; the turn is recorded when the stream ends
        (also when it is interrupted: the partial reply stays in the history)."""
        self.messages.append({"role": "user", "content": user_text})
        text, tokens = self._prompt()
        out: list[int] = []
        said: list[str] = []
        stats = RunStats()
        happened = True
        try:
            for event in stream_generate(self.engine, tokens, max_tokens, cancel=stop):
                stats = event.stats
                out.extend(event.tokens)
                said.append(event.text)
                yield event
        except SpecrunError:
            if not out:  # nothing generated (say, the prompt no longer fits): no turn happened
                self.messages.pop()
                happened = False
            raise
        finally:
            if happened:
                self._record(user_text, text, tokens, out, "".join(said), stats)

    def _record(self, user_text: str, text: str, tokens: list[int], out: list[int], reply: str, stats: RunStats) -> None:
        target = self.engine.target
        # the end-of-turn token is left out: the template writes its own (which may differ)
        self.past_tokens = tokens + [t for t in out if not target.is_eog(t)]
        self.past_text = text + reply
        if stats.finish_reason is None:
            stats.finish_reason = "interrupted"
        self.messages.append({"role": "assistant", "content": reply})
        self.turns.append(Turn(user_text, reply, stats))
        self.totals.merge(stats)

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays) and clear the caches."""
        self.messages.clear()
        self.past_tokens, self.past_text = [], ""
        self.engine.reset()

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.messages.clear()

    def transcript(self) -> dict:
        return {
            "system": self.system,
            "messages": self._conversation(),
            "turns": [{"user": t.user, "reply": t.reply, "stats": t.stats.to_json()} for t in self.turns],
            "totals": self.totals.to_json(),
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the transcript and stats as JSON atomically: a temp file, then a rename, so an
        interruption never leaves a half-written file."""
        p = Path(path).expanduser()
        if p.is_dir():
            raise InputError(f"{p} is a directory", "give a file name, e.g. /save chat.json")
        data = json.dumps(self.transcript(), indent=2, ensure_ascii=False)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, p)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            raise InputError(f"cannot write {p}: {e.strerror or e}", "pick another path") from None
        return p
