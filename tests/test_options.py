"""One source of options: every model-loading command takes the same flags, with the same
defaults and ranges, and names the flag when it refuses a value."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from specrun.cli.main import _register, app, main
from specrun.cli.options import LOADING, SAMPLING, flag_name
from specrun.decode.engine import Settings
from specrun.decode.sampling import Sampler
from specrun.errors import EXIT_USAGE
from specrun.run.config import PairConfig

LOADERS = ["generate", "chat", "bench"]
BAD = [
    (["--gpu-layers", "-2"], "--gpu-layers"),
    (["-c", "8"], "-c/--ctx"),
    (["-t", "0"], "-t/--threads"),
    (["--fixed", "--draft-max", "0"], "--draft-max"),
    (["--gpu-layers-draft", "-3"], "--gpu-layers-draft"),
    (["--draft-min", "70"], "--draft-min"),
    (["--draft-p-min", "1.5"], "--draft-p-min"),
    (["--tie-margin", "-1"], "--tie-margin"),
]


def params(command: str) -> dict[str, object]:
    _register()
    cmd = typer.main.get_command(app).commands[command]
    return {p.name: p for p in cmd.params}


@pytest.mark.parametrize("command", LOADERS)
@pytest.mark.parametrize("args, flag", BAD)
def test_every_loading_command_refuses_the_same_values(tiny, capsys, command, args, flag):
    if command == "bench" and "--draft-min" in args:
        args = [*args, "--draft-max", "8"]  # bench's modes are its own --draft list
    code = main([command, "-m", str(tiny["target"]), *args])
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == EXIT_USAGE, err
    assert len(lines) == 1 and lines[0].startswith(f"specrun: error: {flag} ") and "Traceback" not in err, err


def test_check_pair_takes_the_same_context_range(tiny, capsys):
    code = main(["check-pair", "-m", str(tiny["target"]), "-d", str(tiny["draft-copy"]), "-c", "8"])
    assert code == EXIT_USAGE and "-c/--ctx" in capsys.readouterr().err


@pytest.mark.parametrize("command", LOADERS)
def test_loading_commands_share_flags_and_defaults_from_the_core(command):
    p = params(command)
    cores = {f.name: f for cls in (PairConfig, Settings, Sampler) for f in dataclasses.fields(cls)}
    for flag in LOADING + (SAMPLING if command != "bench" else ()):
        if command == "bench" and flag.field == "mode":
            continue  # bench's --draft is a list of modes to compare
        assert flag.field in p, (command, flag.field)
        if flag.field in cores:
            f = cores[flag.field]
            want = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            given = flag.parse(p[flag.field].default) if flag.parse else p[flag.field].default  # text -> the core's value
            assert given == want, (command, flag.field)


def test_flag_names_for_core_settings():
    assert flag_name("draft_max") == "--draft-max"
    assert flag_name("n_ctx") == "-c/--ctx"
    assert flag_name("temperature") == "--temp"
    assert flag_name("not_a_setting") == "not_a_setting"
