"""ChatSession on the tiny models (KV reuse, /save, reset), a model with a hostile template,
and `specrun chat` with piped stdin (plain text, no terminal codes). The templates themselves
are tested in test_template.py."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import bpe_vocab, make_weights, write_model

from specrun.decode.costs import CostModel
from specrun.decode.engine import Engine, Settings
from specrun.decode.learned import Learned
from specrun.decode.sampling import Sampler
from specrun.errors import InputError, PromptTooLong
from specrun.gguf.facts import model_info
from specrun.llama import LoadOptions, Model
from specrun.run.chat import ChatSession
from specrun.run.template import ChatTemplate, TemplateError, plain_format

SPECRUN = Path(sys.executable).parent / "specrun"
ANSI = re.compile(r"\x1b[\[\]()]")
# verifying is nearly free: the chooser drafts, so the KV reuse is tested with drafting on
FLAT = {b: 0.001 * (1 + 0.01 * b) for b in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}


@pytest.fixture(scope="module")
def models(tiny):
    opts = LoadOptions(n_ctx=1024, n_threads=1)
    loaded = {"target": Model(tiny["target"], opts), "draft": Model(tiny["draft-copy"], opts)}
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.fixture
def session(models, tiny):
    """A new session; the caches are cleared so nothing is reused from another test."""
    models["target"].reset()
    models["draft"].reset()
    info = model_info(tiny["target"])
    engine = Engine(
        models["target"],
        models["draft"],
        Settings("model"),
        Sampler(0.0),
        learned=Learned(CostModel(dict(FLAT)), {"model": {"per_token": 0.0001}}),
    )
    warnings: list[str] = []
    s = ChatSession(engine, ChatTemplate(info.chat_template, "<|endoftext|>", "<|im_end|>"), warn=warnings.append)
    s.warnings = warnings  # type: ignore[attr-defined]
    return s


def chat(s: ChatSession, text: str, n: int = 24) -> list[int]:
    out = []
    for step in s.send(text, n):
        out.extend(step.tokens)
    return out


def new_turn_tokens(target: Model, user_text: str) -> list[int]:
    """What a turn adds after the previous reply, in the tiny models' ChatML template."""
    suffix = f"<|im_end|>\n<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
    return target.tokenize(suffix, add_special=False, parse_special=True)


# --- KV reuse ---------------------------------------------------------------------------


def test_each_turn_prefills_only_its_own_tokens(session):
    target = session.engine.target
    first = "Hello there, how are you?"
    p1 = target.tokenize(f"<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n", add_special=False, parse_special=True)
    chat(session, first)
    t1 = session.turns[-1]
    assert t1.stats.n_prompt_tokens == len(p1)

    conversation = len(p1) + t1.stats.n_generated
    for text in ("Tell me about the quick brown fox.", "def fibonacci(n): ぬ and again"):
        before = session.turns[-1]
        chat(session, text)
        turn = session.turns[-1]
        suffix = new_turn_tokens(target, text)
        conversation += len(suffix) + turn.stats.n_generated
        # the previous reply's last token was still pending (not in the cache) unless it was
        # the end-of-turn token, which the template replaces with its own
        pending = 0 if before.stats.finish_reason == "stop" else 1
        assert turn.stats.n_prompt_tokens == len(suffix) + pending, (before.stats.finish_reason, turn.stats.to_json())
        assert turn.stats.n_prompt_tokens < conversation / 2
    # the cache holds the conversation exactly as it was generated
    assert target.tokens == session.past_tokens[: len(target.tokens)]
    assert len(target.tokens) >= len(session.past_tokens) - 1


def test_reused_cache_gives_the_same_reply_as_a_fresh_prefill(session, models):
    chat(session, "The quick brown fox jumps over the lazy dog.")
    session.messages.append({"role": "user", "content": "Once more, with feeling."})
    prompt = session.prompt_tokens()
    session.messages.pop()
    reused = chat(session, "Once more, with feeling.")
    assert session.turns[-1].stats.n_prompt_tokens < len(prompt) / 2

    fresh = Engine(models["target"], None, Settings("none"), Sampler(0.0))
    fresh.reset()
    plain = [t for step in fresh.generate(prompt, 24) for t in step.tokens]
    assert reused == plain


def test_reset_clears_history_and_cache(session):
    session.set_system("Be brief.")
    chat(session, "Hello")
    chat(session, "Again")
    assert len(session.messages) == 4
    session.reset()
    assert session.messages == [] and session.past_tokens == []
    assert session.engine.target.n_past == 0 and session.engine.tokens == []
    assert session.system == "Be brief."  # the system prompt stays
    full = session.engine.target.tokenize(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        add_special=False,
        parse_special=True,
    )
    chat(session, "Hello")
    assert session.turns[-1].stats.n_prompt_tokens == len(full)  # everything prefilled again
    assert len(session.turns) == 3  # the turns (and totals) are a session log, kept


def test_system_prompt_starts_a_new_conversation(session):
    chat(session, "Hello")
    session.set_system("You are a pirate.")
    assert session.messages == []
    chat(session, "Ahoy")
    expected = session.engine.target.tokenize(
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nAhoy<|im_end|>\n<|im_start|>assistant\n",
        add_special=False,
        parse_special=True,
    )
    # only the shared "<|im_start|>" could be kept from the old conversation
    assert session.turns[-1].stats.n_prompt_tokens == len(expected) - 1


def test_interrupted_reply_stays_in_the_history(session):
    import threading

    stop = threading.Event()
    out = []
    for step in session.send("Tell me a long story.", 500, stop):
        out.extend(step.tokens)
        if out:  # (a round that defers a near-tie emits nothing)
            stop.set()  # like Ctrl-C: the engine stops before its next round
    turn = session.turns[-1]
    assert turn.stats.finish_reason == "interrupted"
    assert 1 <= turn.stats.n_generated == len(out) < 500
    assert session.messages[-1] == {"role": "assistant", "content": turn.reply}
    chat(session, "Go on.")  # the session continues, reusing the cache
    assert session.turns[-1].stats.n_prompt_tokens <= len(new_turn_tokens(session.engine.target, "Go on.")) + 1


def test_prompt_too_long_leaves_no_half_turn(tiny):
    opts = LoadOptions(n_ctx=256, n_threads=1)
    with Model(tiny["target"], opts) as target:
        info = model_info(tiny["target"])
        s = ChatSession(Engine(target, None, Settings("none"), Sampler(0.0)), ChatTemplate(info.chat_template))
        with pytest.raises(PromptTooLong):
            chat(s, "word " * 400)
        assert s.messages == [] and s.turns == []
        chat(s, "Hello", n=8)  # a short message still works
        assert len(s.turns) == 1 and s.messages[0]["content"] == "Hello"


# --- /save ------------------------------------------------------------------------------


def test_save_writes_valid_json_atomically(session, tmp_path):
    session.set_system("Réponds en français. ぬ")
    chat(session, "Hello ぬ")
    chat(session, "Again")
    path = tmp_path / "sub" / "chat.json"
    assert session.save(path) == path
    data = json.loads(path.read_text(encoding="utf-8"))
    assert set(data) == {"system", "messages", "turns", "totals"}
    assert data["system"] == "Réponds en français. ぬ"
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert data["messages"][1]["content"] == "Hello ぬ"
    assert [t["user"] for t in data["turns"]] == ["Hello ぬ", "Again"]
    assert data["turns"][0]["reply"] == session.turns[0].reply
    assert data["turns"][1]["stats"]["n_prompt_tokens"] == session.turns[1].stats.n_prompt_tokens
    assert data["totals"]["n_generated"] == sum(t.stats.n_generated for t in session.turns)
    assert "ぬ" in path.read_text(encoding="utf-8")  # written as UTF-8, not \u escapes
    assert sorted(p.name for p in path.parent.iterdir()) == ["chat.json"]  # no temp file left

    # saving again replaces the file whole
    chat(session, "Third")
    session.save(path)
    assert len(json.loads(path.read_text(encoding="utf-8"))["turns"]) == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["chat.json"]


def test_save_failure_keeps_the_old_file_and_leaves_no_temp(session, tmp_path, monkeypatch):
    chat(session, "Hello")
    path = tmp_path / "chat.json"
    path.write_text("previous contents", encoding="utf-8")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(InputError, match="cannot write"):
        session.save(path)
    assert path.read_text(encoding="utf-8") == "previous contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.json"]


def test_save_refuses_a_directory_and_an_unwritable_parent(session, tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        session.save(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InputError, match="cannot write"):
        session.save(blocker / "chat.json")


# --- a model whose template is hostile --------------------------------------------------


def test_a_model_with_a_hostile_template_chats_in_the_plain_format(tmp_path, models):
    vocab = dataclasses.replace(bpe_vocab(), chat_template="{{ raise_exception('no chat for you') }}")
    path = write_model(tmp_path / "bad-template.gguf", vocab=vocab, weights=make_weights(1, len(vocab)))
    info = model_info(path)
    assert info.chat_template == "{{ raise_exception('no chat for you') }}"
    warnings: list[str] = []
    target = models["target"]  # the same weights and vocabulary: only the template differs
    target.reset()
    s = ChatSession(Engine(target, None, Settings("none"), Sampler(0.0)), ChatTemplate(info.chat_template), warn=warnings.append)
    expected = target.tokenize(plain_format([{"role": "user", "content": "Hello"}]), add_special=False, parse_special=True)
    chat(s, "Hello", n=8)
    assert s.turns[-1].stats.n_prompt_tokens == len(expected)
    assert warnings and "template raised: no chat for you" in warnings[0]
    with pytest.raises(TemplateError):
        ChatTemplate(info.chat_template).render([{"role": "user", "content": "x"}])


# --- `specrun chat` without a terminal ------------------------------------------------------


def run_chat(tiny, stdin: str, *extra: str, timeout: float = 120, model: Path | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE", "TTY_COMPATIBLE")}
    env["TERM"] = "xterm-256color"  # a capable terminal type: only the missing tty turns colour off
    argv = [
        str(SPECRUN),
        "chat",
        "-m",
        str(model or tiny["target"]),
        "-d",
        str(tiny["draft-copy"]),
        "-t",
        "1",
        "-n",
        "24",
        "-c",
        "1024",
        *extra,
    ]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout)


def test_chat_with_piped_stdin_is_plain_text(tiny, tmp_path):
    save = tmp_path / "t.json"
    p = run_chat(tiny, f"hello\n/stats\n/help\n/bogus\n/system Be brief.\nsecond turn\n/save {save}\n/reset\n/quit\n")
    assert p.returncode == 0, p.stderr
    assert not ANSI.search(p.stdout), repr(p.stdout[:500])
    assert not ANSI.search(p.stderr), repr(p.stderr[:500])
    assert "Session" in p.stdout and "Acceptance per draft position" in p.stdout  # /stats
    assert "/reset" in p.stdout and "/save FILE" in p.stdout  # /help
    assert "unknown command /bogus" in p.stdout
    assert "system prompt set; new conversation" in p.stdout
    assert f"saved {save}" in p.stdout
    assert "conversation cleared (KV cache reset)" in p.stdout
    turn_lines = [line for line in p.stderr.splitlines() if re.match(r"\d+ tokens in ", line)]
    assert len(turn_lines) == 2 and all("prompt " in line and "finish: " in line for line in turn_lines)
    assert re.search(r"^session: \d+ tokens in ", p.stderr, re.M)
    data = json.loads(save.read_text(encoding="utf-8"))
    assert data["system"] == "Be brief." and [t["user"] for t in data["turns"]] == ["hello", "second turn"]
    assert "> " not in p.stdout  # no prompt is drawn without a terminal


def test_chat_end_of_input_exits_zero_with_a_summary(tiny):
    p = run_chat(tiny, "hello")  # no newline, no /quit: EOF ends the session
    assert p.returncode == 0, p.stderr
    assert re.search(r"^session: \d+ tokens in ", p.stderr, re.M)


def test_chat_with_a_hostile_template_warns_once(tiny, tmp_path):
    vocab = dataclasses.replace(bpe_vocab(), chat_template="{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}{% endfor %}")
    bad = write_model(tmp_path / "slow-template.gguf", vocab=vocab, weights=make_weights(1, len(vocab)))
    p = run_chat(tiny, "one\ntwo\n/quit\n", model=bad)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("template ran longer than") == 1, p.stderr  # warned once, not per turn
    assert len([line for line in p.stderr.splitlines() if re.match(r"\d+ tokens in ", line)]) == 2


# --- the REPL in-process: a Ctrl-C before the first round of a reply -----------------------


def test_ctrl_c_before_the_first_round_stops_only_that_reply(tiny, monkeypatch, capsys):
    import io
    import signal

    from rich.console import Console

    from specrun.cli.chat import Repl
    from specrun.run.config import PairConfig
    from specrun.run.session import open_pair

    pair = open_pair(tiny["target"], None, PairConfig(512, 0, None, 1, False))
    try:
        engine = Engine(pair.target, None, Settings("none"), Sampler(0.0))
        monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n/quit\n"))
        repl = Repl(pair, engine, None, 8, Console(stderr=True))
        real_send = repl.session.send
        calls = []

        def send(text, *args):
            calls.append(text)
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C lands while the prompt is prefilled
            return real_send(text, *args)

        monkeypatch.setattr(repl.session, "send", send)
        assert repl.run() == 0
    finally:
        pair.close()
    err = capsys.readouterr().err
    assert calls == ["first", "second"]  # the session went on to the second message
    assert "(reply stopped; the session continues)" in err
    assert [t.stats.finish_reason for t in repl.session.turns][0] == "interrupted"
    assert len(repl.session.turns) == 2
