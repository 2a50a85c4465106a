"""llama.cpp's own speculative decoding, run on the bench's prompts beside specrun's modes.

The outside baseline a user of llama.cpp knows: ``llama-speculative-simple`` with one
``--spec-type`` (its draft model, ``draft-simple``; a block drafter, ``draft-dflash`` or
``draft-dspark``; or one of its n-gram lookups), greedy, at
its defaults or with a fixed ``--spec-draft-n-max`` (and ``--spec-draft-p-min``). It runs as its own process on the same
GGUF files and the same prompt text (the chat template rendered here, so both tools read the
same tokens), and reports its own decode speed, which excludes loading and the prompt, as
specrun's does. A setting is written ``TYPE`` (its defaults), ``TYPE@N`` (n-max N) or ``TYPE@N/P``
(n-max N, p-min P).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from specrun.decode.stats import RunStats
from specrun.errors import InputError, UsageError
from specrun.gguf.architecture import installed_version

TOOL = "llama-speculative-simple"
DRAFT_SETTINGS = ("draft-simple", "draft-simple@4", "draft-simple@8", "draft-simple@16")  # what --draft 8 users compare
NGRAM_SETTINGS = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
BLOCK_TYPES = {"dflash": "draft-dflash", "dflash2": "draft-dflash", "dspark": "draft-dspark"}  # by the drafter's kind
TYPES = ("draft-simple", "draft-dflash", "draft-dspark", *NGRAM_SETTINGS)
PREFIX = "llama.cpp:"  # how the bench names these modes, beside its own

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def find_bin(given: Path | None = None) -> Path:
    """The folder that holds the tool: ``given``, else ``$SPECRUN_LLAMA_CPP_BIN``, else the
    build that ``scripts/compare-llama-cpp.sh --build-only`` makes from the installed
    llama-cpp-python's own sources (so both tools run the same kernels), else ``PATH``'s."""
    named = given or (Path(os.environ["SPECRUN_LLAMA_CPP_BIN"]) if os.environ.get("SPECRUN_LLAMA_CPP_BIN") else None)
    if named is None:
        cache = Path(os.environ.get("SPECRUN_CACHE") or Path.home() / ".cache" / "specrun")
        on_path = shutil.which(TOOL)
        candidates = [cache / f"llama.cpp-{installed_version()}" / "build" / "bin", *([Path(on_path).parent] if on_path else [])]
        named = next((c for c in candidates if (c / TOOL).is_file()), None)
        if named is None:
            raise InputError(
                f"llama.cpp's {TOOL} was not found (looked in {candidates[0]} and on PATH)",
                "build it with scripts/compare-llama-cpp.sh --build-only, or set SPECRUN_LLAMA_CPP_BIN to a llama.cpp build/bin",
            )
    if not (named / TOOL).is_file():
        raise InputError(f"llama.cpp's {TOOL} is not in {named}", "give the build/bin of a llama.cpp build that has it")
    return named


def write_prompt(path: Path, text: str) -> Path:
    """The prompt file the tool reads as exactly ``text``: it drops one newline from the end of
    a prompt file, and a chat prompt ends in one (ChatML's ends with "assistant" and a newline),
    so the file gets one more."""
    path.write_text(text + "\n", encoding="utf-8")
    return path


def parse_settings(text: str | None, has_draft: bool, block: str | None = None, pair_known: bool = True) -> list[str]:
    """``draft-simple,draft-simple@8`` -> the settings; None: the draft model's at its defaults
    and n-max 4, 8 and 16 where the pair has a draft model (``block``: a block drafter of that
    kind, whose type llama.cpp runs it with, at n-max 2, 4, 8 and 16), else every n-gram type.
    ``pair_known`` False: before the pair loads, only the settings' spelling is checked."""
    if text is None:
        if block is not None:
            return [f"{BLOCK_TYPES[block]}@{n}" for n in (2, 4, 8, 16)]
        return list(DRAFT_SETTINGS if has_draft else NGRAM_SETTINGS)
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        kind, sep, rest = spec.partition("@")
        n, slash, p = rest.partition("/")
        if kind not in TYPES or (sep and not (n.isdigit() and 1 <= int(n) <= 256)) or (slash and not _probability(p)):
            raise UsageError(
                f"llama.cpp's settings are its types ({', '.join(TYPES)}), each optionally @N for its n-max "
                f"and /P for its p-min, got {spec!r}",
                "e.g. draft-simple,draft-simple@8,draft-simple@8/0.5",
            )
        if pair_known:
            _check_pair(kind, has_draft, block)
        out.append(spec)
    if not out:
        raise UsageError("llama.cpp's settings: got none", "e.g. draft-simple,draft-simple@8")
    return list(dict.fromkeys(out))


def _check_pair(kind: str, has_draft: bool, block: str | None) -> None:
    """Can llama.cpp's type ``kind`` run this pair's draft (a draft model, a block drafter of
    kind ``block``, or none)?"""
    if kind.startswith("draft") and not has_draft:
        raise UsageError(f"llama.cpp's {kind} needs a draft model", "give the pair a draft model, or pick an n-gram type")
    if kind.startswith("draft") and block is not None and kind != BLOCK_TYPES[block]:
        raise UsageError(f"llama.cpp's {kind} cannot run this pair's {block} block drafter", f"use {BLOCK_TYPES[block]}")
    if kind in BLOCK_TYPES.values() and block is None:
        raise UsageError(f"llama.cpp's {kind} needs a block drafter, and this pair's draft is a draft model", "use draft-simple")


def _probability(text: str) -> bool:
    try:
        return 0.0 <= float(text) <= 1.0
    except ValueError:
        return False


@dataclass(frozen=True)
class LlamaCpp:
    """The tool, and what every run of it shares with specrun's own: the files, threads, context."""

    bin: Path
    target: Path
    draft: Path | None
    threads: int
    n_ctx: int
    gpu_layers: int = -1  # -1: every layer, as specrun's default

    def command(self, setting: str, prompt_file: Path, n: int) -> list[str]:
        """The tool's command line for one setting (``TYPE``, ``TYPE@N`` or ``TYPE@N/P``), greedy."""
        kind, _, rest = setting.partition("@")
        n_max, _, p_min = rest.partition("/")
        ngl = str(999 if self.gpu_layers < 0 else self.gpu_layers)
        cmd = [str(self.bin / TOOL), "-m", str(self.target), "-f", str(prompt_file), "-n", str(n), "--temp", "0"]
        cmd += ["-t", str(self.threads), "-c", str(self.n_ctx), "-ngl", ngl, "--spec-type", kind]
        cmd += ["--spec-draft-n-max", n_max] if n_max else []
        cmd += ["--spec-draft-p-min", p_min] if p_min else []
        if kind.startswith("draft") and self.draft is not None:
            cmd += ["-md", str(self.draft), "-td", str(self.threads), "-ngld", ngl]
        return cmd

    def run(self, setting: str, prompt_file: Path, n: int) -> RunStats:
        """One generation of ``n`` tokens from the prompt in ``prompt_file``: the tool's own
        tokens per second, tokens drafted and accepted."""
        cmd = self.command(setting, prompt_file, n)
        for _ in range(10):  # its log is written by a thread that a quick exit can cut short: a run of
            # a few milliseconds (a tiny model's) loses its report, exit 0, in 1 of 4-5 runs here (a demo
            # model's run none of 12); that run is repeated
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=3600)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise InputError(
                    f"llama.cpp's {TOOL} did not run: {e}", "check the build, or set SPECRUN_LLAMA_CPP_BIN to another"
                ) from None
            stats = parse_output(p.stdout + p.stderr)
            if p.returncode != 0 or stats is not None:
                break
        if p.returncode != 0 or stats is None:
            last = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise InputError(f"llama.cpp's {TOOL} failed ({setting}, exit {p.returncode}): {last}", "run it by hand: " + " ".join(cmd))
        return stats


def parse_output(text: str) -> RunStats | None:
    """The tool's closing report as specrun's run statistics; None where it has none."""
    m = _DECODED.search(text)
    if m is None:
        return None
    n, seconds, speed = int(m.group(1)), float(m.group(2)), float(m.group(3))
    prompt, drafted, accepted = _ENCODED.search(text), _DRAFTED.search(text), _ACCEPTED.search(text)
    return RunStats(
        n_prompt_tokens=int(prompt.group(1)) if prompt else 0,
        prompt_s=float(prompt.group(2)) if prompt else 0.0,
        n_generated=n,
        wall_s=n / speed if speed > 0 else seconds,  # its speed has more digits than its seconds
        n_drafted=int(drafted.group(1)) if drafted else 0,
        n_accepted=int(accepted.group(1)) if accepted else 0,
    )
