"""Chat templates (specrun/run/template.py): hostile templates are refused with one line and fall
back to the plain ChatML format, in a child process so a hang cannot stall the run; the
templates real models use still render."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from specrun.run.template import ChatTemplate, plain_format

# --- hostile chat templates ---------------------------------------------------------------

SENTINEL = "SENTINEL_PATH"  # replaced by a path in tmp_path: no template may create it

HOSTILE = {
    "raise": "{{ raise_exception('x') }}",
    "range-huge": "{% for i in range(10**9) %}x{% endfor %}",
    "nested-loops": "{% for a in range(9999) %}{% for b in range(9999) %}{% endfor %}{% endfor %}",
    "class-bases": "{{ ().__class__.__bases__ }}",
    "subclasses": "{{ ().__class__.__bases__[0].__subclasses__() }}",
    "cycler-globals": "{{ cycler.__init__.__globals__ }}",
    "cycler-os-system": "{{ cycler.__init__.__globals__.os.system('touch SENTINEL_PATH') }}",
    "namespace-globals": "{{ namespace.__init__.__globals__['os'].system('touch SENTINEL_PATH') }}",
    "raise-globals": "{{ raise_exception.__globals__['__builtins__']['open']('SENTINEL_PATH', 'w') }}",
    "include-passwd": "{% include '/etc/passwd' %}",
    "import-os": "{% import 'os' as os %}{{ os.system('touch SENTINEL_PATH') }}",
    "extends-passwd": "{% extends '/etc/passwd' %}",
    "attr-filter": "{{ ''|attr('__class__') }}",
    "mutate-messages": "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "recursion": "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}",
    "huge-power-folded": "{{ 10 ** (10 ** 10) }}",
    "huge-power": "{% set n = 10 ** 10 %}{{ 9 ** n }}",
    "huge-string-folded": "{{ 'x' * (10 ** 10) }}",
    "huge-center": "{{ 'x' | center(10 ** 10) }}",
    "huge-format-width": "{{ '{:>9999999999}'.format(1) }}",
    "huge-printf-width": "{{ '%9999999999d' % 1 }}",
    "huge-replace": "{% set s = 'x' * 4000000 %}{{ s | replace('x', s) }}",
    "huge-join": "{% set s = 'x' * 100000 %}{{ ([s] * 100000) | join }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "squaring": "{% set ns = namespace(x=3) %}{% for i in range(60) %}{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "str-translate": "{{ 'ab'.translate({97: 'zz'}) }}",
    "output-cap": "{% for i in range(9999) %}{{ 'x' * 3999999 }}{% endfor %}",
}
FIRST_LINE_OF_PASSWD = "root:"

CHILD = textwrap.dedent(
    """
    import json, sys
    from specrun.run.template import ChatTemplate, TemplateError, render_chat
    cases = json.loads(sys.stdin.read())
    for name, src in cases.items():
        print(json.dumps({"start": name}), flush=True)
        try:
            out = ChatTemplate(src, "<s>", "</s>").render([{"role": "user", "content": "hi"}])
            result = {"kind": "rendered", "detail": out[:200], "len": len(out)}
        except TemplateError as e:
            result = {"kind": "TemplateError", "detail": str(e)}
        except BaseException as e:
            result = {"kind": type(e).__name__, "detail": str(e)[:300]}
        if result["kind"] == "TemplateError":  # what a chat does with it
            warned = []
            result["fallback"] = render_chat(ChatTemplate(src), [{"role": "user", "content": "hi"}], warned.append)
            result["warned"] = warned
        result["name"] = name
        print(json.dumps(result), flush=True)
    """
)


@pytest.fixture(scope="module")
def hostile_results(tmp_path_factory):
    """Every hostile template rendered in one child process (so a hang cannot stall the test
    run): name -> result, or no entry for a template the child never finished."""
    sentinel = tmp_path_factory.mktemp("hostile") / "pwned"
    cases = {k: v.replace(SENTINEL, str(sentinel)) for k, v in HOSTILE.items()}
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD], input=json.dumps(cases), capture_output=True, text=True, timeout=20 + 4 * len(cases)
        )
        stdout = p.stdout
    except subprocess.TimeoutExpired as e:
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    results = {}
    for line in stdout.splitlines():
        d = json.loads(line)
        if "name" in d:
            results[d["name"]] = d
    return results, sentinel


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused_and_falls_back(hostile_results, name):
    results, sentinel = hostile_results
    assert name in results, f"{name}: the render never finished (hung or crashed the process)"
    r = results[name]
    assert r["kind"] == "TemplateError", r
    assert r["detail"].startswith("template "), r  # one line that names the template as the cause
    assert r["fallback"] == plain_format([{"role": "user", "content": "hi"}])
    assert len(r["warned"]) == 1 and "using a plain ChatML format instead" in r["warned"][0]
    assert FIRST_LINE_OF_PASSWD not in r["detail"]
    assert not sentinel.exists(), f"{name} executed code"


def test_templates_that_real_models_use_still_render():
    qwen_like = (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}"
        "{%- set ns = namespace(n=0) %}"
        "{%- for message in messages %}{%- set ns.n = ns.n + 1 %}"
        "{%- if message.role != 'system' %}{{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>' + '\\n' }}{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        "{{- '' if ns.n == messages | length else raise_exception('count') }}"
        "{{- (messages | map(attribute='role') | join(',')) | replace('user', '') | length * 0 * '' }}"
        "{{- '%s' | format('') }}{{- '{}'.format('') }}{{- ('a' ~ 'b') [:0] }}{{- (messages | tojson(indent=2))[:0] }}"
    )
    msgs = [{"role": "user", "content": " hi ぬ "}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    out = ChatTemplate(qwen_like).render(msgs)
    assert out == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi ぬ<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    )
