"""Every `specrun ...` command shown in README.md and docs/*.md still parses: the command exists
and every flag it shows is one of that command's options (a renamed or removed flag fails
here), and the complete command lines of the code blocks pass the command's own parser, values
and all. Also: the README stays short, links every page of docs/, and shows the test command;
every draft mode the engine accepts is in docs/drafting.md's list and in every `--draft` help."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from specrun.cli.main import _command
from specrun.decode.engine import DRAFT_MODES

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`((?:\.venv/bin/)?specrun [^`]+)`")


def block_commands(text: str) -> list[list[str]]:
    """The specrun command lines in a page's shell code blocks, as argv (without `specrun`)."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang not in ("", "sh", "bash", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ")
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value specrun ...
                    words.pop(0)
                if words and words[0] in ("specrun", ".venv/bin/specrun"):
                    out.append(words[1:])
    return out


def span_commands(text: str) -> list[list[str]]:
    """The `specrun ...` spans in a page's prose and tables, as words; placeholders in
    capitals, [optional] brackets, `|` alternatives and `...` are dropped."""
    out = []
    for span in SPAN.findall(text):
        words = span.replace("[", " ").replace("]", " ").replace("\\|", " ").replace("...", " ").split()[1:]
        if words and not words[0].isupper():  # `specrun COMMAND --help` names no command
            out.append(words)
    return out


def options_of(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"-h", "--help"}


def unknown_flags(words: list[str]) -> list[str]:
    """Whatever in ``words`` is not the command or one of its options (empty: it resolves)."""
    group = _command()
    if not words or words[0] not in group.commands:
        return [f"no command {words[0] if words else '(none)'!r}"]
    known = options_of(group.commands[words[0]])
    flags = [w.split("=", 1)[0] for w in words[1:] if w.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", w)]
    return [f for f in flags if f not in known]


def every(kind):
    return [(page.relative_to(ROOT).as_posix(), words) for page in PAGES for words in kind(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize(
    "page, words", every(span_commands) + every(block_commands), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_command_shown_resolves(page, words):
    assert unknown_flags(words) == [], f"{page}: `specrun {' '.join(words)}`"


@pytest.mark.parametrize("page, words", every(block_commands), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_command_line_in_a_code_block_parses(page, words):
    cmd = _command().commands[words[0]]
    try:
        cmd.make_context(f"specrun {words[0]}", list(words[1:]), resilient_parsing=False)
    except click.exceptions.Exit:  # --help
        pass
    except click.ClickException as e:
        pytest.fail(f"{page}: `specrun {' '.join(words)}`: {e.format_message()}")


def test_the_pages_show_the_commands_people_use():
    shown = {words[0] for _, words in every(block_commands)}
    assert {"check-pair", "chat", "generate", "serve", "bench"} <= shown
    assert len(every(span_commands)) >= 20


def test_the_checker_catches_a_renamed_flag_and_a_missing_command():
    assert unknown_flags(["generate", "-m", "x", "--draft-max", "4", "-n", "-1"]) == []
    assert unknown_flags(["generate", "-m", "x", "--draft-maximum", "4"]) == ["--draft-maximum"]
    assert unknown_flags(["check-pairs", "-m", "x"]) == ["no command 'check-pairs'"]
    assert block_commands("```\n$ FOO=1 specrun chat -m a  # a comment\nls && .venv/bin/specrun bench --markdown\n```\n") == [
        ["chat", "-m", "a"],
        ["bench", "--markdown"],
    ]


def test_the_readme_is_short_shows_the_test_command_and_links_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert "\nbash scripts/test.sh\n" in readme
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_links_between_pages_point_at_files_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).is_file(), f"{page.name} links {target}, which does not exist"


# flags the pages show that belong to a script, not to specrun, and the script that takes each
SCRIPT_FLAGS = {
    "--force-backend": "install.sh",
    "--all": "fetch-demo-models.sh",
    "--f16": "fetch-demo-models.sh",
    "--ngram": "compare-llama-cpp.sh",
    "--draft-model": "compare-llama-cpp.sh",
    "--serve": "compare-llama-cpp.sh",
    "--build-only": "compare-llama-cpp.sh",
    "--clients": "tools/compare_serve.py",
    "--setups": "tools/compare_serve.py",
    "--sessions": "tools/replay_sessions.py",
    "--file": "tools/replay_sessions.py",
    "--rows": "tools/dflash_profile.py",
    "--aider": "tools/aider_session.py",
    "--turns": "tools/aider_session.py",
    "--session": "tools/aider_session.py",
}
# flags of llama.cpp's own tools, shown beside specrun's for comparison (not checkable here)
LLAMA_CPP_FLAGS = {"--jinja", "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-p-min"}


def test_every_flag_shown_in_code_is_an_option_of_specrun_or_of_its_script():
    known = set().union(*(options_of(c) for c in _command().commands.values()))
    wrong = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", page.read_text(encoding="utf-8")):
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", span):
                if flag in LLAMA_CPP_FLAGS:
                    continue
                if flag in SCRIPT_FLAGS:
                    assert flag in (ROOT / "scripts" / SCRIPT_FLAGS[flag]).read_text(), (flag, SCRIPT_FLAGS[flag])
                elif flag not in known:
                    wrong.append(f"{page.name}: {flag} in `{span}`")
    assert not wrong, "flags no command takes (renamed?): " + "; ".join(wrong)


def documented_modes(text: str) -> list[str]:
    """The modes listed (`- `mode`: ...`) under drafting.md's "Drafting modes" heading."""
    section = re.search(r"^## Drafting modes[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, 'docs/drafting.md has no "## Drafting modes" section'
    return re.findall(r"^- `([a-z0-9]+)`", section.group(1), re.M)


def test_every_draft_mode_is_in_drafting_md():
    listed = documented_modes((ROOT / "docs" / "drafting.md").read_text(encoding="utf-8"))
    missing = [m for m in DRAFT_MODES if m not in listed]
    stale = [m for m in listed if m not in DRAFT_MODES]
    assert not missing, f"docs/drafting.md's list of draft modes leaves out {missing}"
    assert not stale, f"docs/drafting.md lists modes the engine does not accept: {stale}"


def draft_helps() -> dict[str, str]:
    """Per command with a `--draft` option, that option's help text as `--help` shows it."""
    return {
        name: p.help or "" for name, cmd in sorted(_command().commands.items()) for p in cmd.params if "--draft" in getattr(p, "opts", ())
    }


def test_every_draft_help_lists_every_mode():
    helps = draft_helps()
    assert {"generate", "chat", "serve", "bench"} <= set(helps), sorted(helps)
    wrong = {
        name: missing
        for name, text in helps.items()
        if (missing := [m for m in DRAFT_MODES if not re.search(rf"(?<![\w-]){m}(?![\w-])", text)])
    }
    assert not wrong, "--draft help leaves out modes: " + "; ".join(f"specrun {n}: {', '.join(m)}" for n, m in wrong.items())


def test_the_mode_checks_catch_a_missing_mode():
    assert documented_modes("## Drafting modes (`--draft`)\n\n- `model`: x;\n- `none`: y.\n\n## Next\n- `ngram`: z\n") == [
        "model",
        "none",
    ]
    assert not re.search(r"(?<![\w-])mtp(?![\w-])", "the target's MTP heads, --draft-mtp")
