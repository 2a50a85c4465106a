"""`specrun chat` in a real pseudo-terminal: the live status line, KV reuse across turns,
Ctrl-C (stops a reply, keeps the session), /reset, /quit, Ctrl-D and SIGTERM."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from specrun.decode.engine import Engine, Settings
from specrun.decode.sampling import Sampler
from specrun.gguf.facts import model_info
from specrun.llama import LoadOptions, Model
from specrun.run.chat import ChatSession
from specrun.run.template import ChatTemplate

SPECRUN = Path(sys.executable).parent / "specrun"
# CSI and OSC sequences, charset and keypad switches: what a terminal would interpret
ESCAPES = re.compile(r"\x1b(\[[0-9;?<=>]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-Za-z]|[=>78DEHMNOc])")
SUMMARY = r"(\d+) tokens in [\d.]+ s, [\d.]+ tok/s \| prompt (\d+) tok at [^|]*\|.*?finish: (\w+)"
PROMPT = r"^> "
TIMEOUT = 90  # seconds for any one expected output: the machine may be busy


class Terminal:
    """A child process on a pseudo-terminal, read with select; `expect` waits for a regex in
    the output with terminal escapes removed."""

    def __init__(self, argv: list[str], env: dict[str, str], cols: int = 200, rows: int = 50):
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal and stdin/stdout/stderr
            try:
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        self.raw = b""
        self.pos = 0
        self.exit_code: int | None = None

    def _read(self, timeout: float) -> bool | None:
        """True: read something; False: nothing yet; None: the terminal closed."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child is gone
            data = b""
        if not data:
            return None
        self.raw += data
        return True

    @property
    def text(self) -> str:
        return ESCAPES.sub("", self.raw.decode("utf-8", errors="replace")).replace("\r", "")

    def expect(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        rx = re.compile(pattern, re.S | re.M)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.text, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {pattern!r}; output since:\n{self.text[self.pos :][-3000:]}")
            if self._read(min(left, 0.5)) is None:
                m = rx.search(self.text, self.pos)
                if m:
                    self.pos = m.end()
                    return m
                raise AssertionError(f"the terminal closed before {pattern!r}; output since:\n{self.text[self.pos :][-3000:]}")

    def send(self, s: str) -> None:
        os.write(self.fd, s.encode())

    def wait(self, timeout: float = TIMEOUT) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.05):
                    pass
                self.exit_code = os.waitstatus_to_exitcode(status)
                return self.exit_code
            self._read(0.1)
        raise AssertionError(f"the process did not exit; output:\n{self.text[-3000:]}")

    def close(self) -> None:
        if self.exit_code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except OSError:
                pass
        os.close(self.fd)


def terminal_env() -> dict[str, str]:
    """This environment as a colour terminal of its own size would see it: nothing forcing or
    removing colour, and no width or height but the pseudo-terminal's."""
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    return env


@pytest.fixture
def spawn(tiny):
    terminals = []

    def start(*extra: str, draft: bool = True) -> Terminal:
        env = terminal_env()
        argv = [str(SPECRUN), "chat", "-m", str(tiny["target"]), "-t", "1", "-c", "4096", *extra]
        if draft:
            argv += ["-d", str(tiny["draft-copy"])]
        t = Terminal(argv, env)
        terminals.append(t)
        return t

    yield start
    for t in terminals:
        t.close()


@pytest.fixture(scope="module")
def tokenizer(tiny):
    with Model(tiny["target"], LoadOptions(n_ctx=256, n_threads=1)) as m:
        yield lambda text: m.tokenize(text, add_special=False, parse_special=True)


LONG = 1000


@pytest.fixture(scope="module")
def long_reply(tiny) -> str:
    """A first message whose greedy reply runs to LONG tokens at least (the tiny models often
    stop early), found by chatting in-process: greedy decoding is deterministic."""
    with Model(tiny["target"], LoadOptions(n_ctx=4096, n_threads=1)) as target:
        template = ChatTemplate(model_info(tiny["target"]).chat_template)
        for text in ("The quick brown fox", "1 2 3 4 5 6 7 8 9", "more, more", "Tell me a long story."):
            target.reset()
            s = ChatSession(Engine(target, None, Settings("none"), Sampler(0.0)), template)
            for _ in s.send(text, LONG):
                pass
            if s.turns[-1].stats.finish_reason == "length":
                return text
    pytest.fail(f"no candidate message gets a {LONG}-token reply from the tiny target")


def first_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def next_prompt(text: str) -> str:
    """What a later turn adds after the previous reply."""
    return f"<|im_end|>\n{first_prompt(text)}"


def turn(t: Terminal, text: str) -> tuple[int, int, str]:
    """Send one message; return (tokens generated, prompt tokens evaluated, finish reason)."""
    t.send(text + "\r")
    m = t.expect(SUMMARY)
    t.expect(PROMPT)
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_two_turns_reuse_the_cache_then_reset_and_quit(spawn, tokenizer):
    t = spawn("-n", "24")
    t.expect(r"specrun chat: tiny-target \+ tiny-draft-copy\. /help for commands")
    t.expect(PROMPT)

    # turn 1 evaluates its whole prompt
    first = "Hello there, how are you?"
    gen1, prompt1, finish1 = turn(t, first)
    assert prompt1 == len(tokenizer(first_prompt(first)))
    assert "tok/s" in t.text and "accept" in t.text and "draft K=" in t.text  # the live status line
    assert b"\x1b[" in t.raw  # a terminal: Rich drew with escape codes

    # turn 2 evaluates only its own tokens: the cache holds turn 1's prompt and reply
    second = "Tell me about the quick brown fox."
    gen2, prompt2, finish2 = turn(t, second)
    new = len(tokenizer(next_prompt(second)))
    # the last reply token was still pending in the cache, unless it was the end-of-turn
    # token, which the template writes itself
    assert prompt2 == new + (0 if finish1 == "stop" else 1), (gen1, finish1)
    assert prompt2 < prompt1 + gen1 + new

    # Ctrl-C at the prompt cancels the line only
    t.send("half a line")
    t.expect(r"half a line")  # readline has the line (it echoed it): the Ctrl-C lands in its input
    t.send("\x03")
    t.expect(PROMPT)
    t.send("/stats\r")
    t.expect(r"Acceptance per draft position")
    t.expect(PROMPT)

    t.send("/reset\r")
    t.expect(r"conversation cleared \(KV cache reset\)")
    t.expect(PROMPT)
    gen3, prompt3, _ = turn(t, first)
    assert prompt3 == prompt1  # nothing is reused after /reset

    t.send("/quit\r")
    assert t.wait() == 0
    m = t.expect(r"^session: " + SUMMARY)
    assert int(m.group(1)) == gen1 + gen2 + gen3
    assert int(m.group(2)) == prompt1 + prompt2 + prompt3


def test_ctrl_c_stops_a_reply_and_the_session_continues(spawn, tokenizer, long_reply):
    t = spawn("-n", str(2 * LONG), "--draft", "none", draft=False)
    t.expect(PROMPT)
    t.send(long_reply + "\r")
    t.expect(r"tok/s")  # the reply is streaming
    t.send("\x03")
    m = t.expect(SUMMARY)
    t.expect(PROMPT)
    assert m.group(3) == "interrupted", m.group(0)
    assert "(reply stopped; the session continues)" in t.text
    assert int(m.group(1)) < LONG

    # one more turn works, and reuses the cache: the partial reply is in the history
    # no Ctrl-C here: a reply that ends as it lands leaves the signal to readline's
    # check-then-select window, where it cancels the next line typed (/quit below) instead;
    # at this speed even a 2*LONG-token reply ends within seconds
    t.send("Go on.\r")
    m = t.expect(SUMMARY)
    assert int(m.group(2)) == len(tokenizer(next_prompt("Go on."))) + 1
    t.expect(PROMPT)

    t.send("/quit\r")
    assert t.wait() == 0
    t.expect(r"^session: " + SUMMARY)


def _sigint_takers(pid: int) -> list[int]:
    """The process's threads other than its main one that do not block SIGINT."""
    out = []
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
        if tid != pid and not blocked & (1 << (signal.SIGINT - 1)):
            out.append(tid)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sends a signal to one thread (tgkill, /proc)")
def test_a_ctrl_c_the_prompt_missed_is_sent_again(spawn):
    """readline misses a signal that lands between its check and its select(), or that another
    thread of the process takes: the line would be cancelled only at the next keystroke. Here
    Ctrl-C's signal is sent to another thread on purpose, so the prompt's select() never wakes
    for it; the prompt still acts on it (it is sent to the main thread again)."""
    import ctypes

    t = spawn("-n", "24")
    t.expect(PROMPT)
    t.send("half a line")
    t.expect(r"half a line")
    takers = _sigint_takers(t.pid)
    assert takers, "no thread but the main one could take the signal"
    assert ctypes.CDLL(None, use_errno=True).tgkill(t.pid, takers[0], signal.SIGINT) == 0
    t.expect(PROMPT)
    t.send("/quit\r")
    assert t.wait() == 0


def test_ctrl_d_exits_zero(spawn):
    t = spawn("-n", "24")
    t.expect(PROMPT)
    gen, _, _ = turn(t, "Hello")
    t.send("\x04")
    assert t.wait() == 0
    m = t.expect(r"^session: " + SUMMARY)
    assert int(m.group(1)) == gen


def test_sigterm_at_the_prompt_exits_143(spawn):
    t = spawn("-n", "24", draft=False)
    t.expect(PROMPT)
    os.kill(t.pid, signal.SIGTERM)
    assert t.wait() == 143  # with nothing more typed: it does not wait for the next line
    t.expect(r"^session: ")


def test_sigterm_during_a_reply_exits_143(spawn):
    t = spawn("-n", "2000", "--draft", "none", draft=False)
    t.expect(PROMPT)
    t.send("Tell me a long story.\r")
    t.expect(r"tok/s")
    os.kill(t.pid, signal.SIGTERM)
    assert t.wait() == 143
    t.expect(r"^session: ")
