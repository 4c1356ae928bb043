"""Every chat template render has one time and memory budget (finetune.data.template_budget; issue 34 item 17):
`'a' * 3e9` is refused before it allocates, loops over loops stop, and the tokenizer's own template is checked
by preflight (--dry-run) as a recipe's is, not first at launch."""

from __future__ import annotations

import json
import resource
import shutil

import pytest
from typer.testing import CliRunner

import finetune.data.template_budget as budget
from finetune.cli import app
from finetune.data.template_budget import MAX_CHARS, TemplateBudget, render, render_for, render_with_spans
from tests.fuzzing import time_limit

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
ORDINARY = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
NESTED = "".join("{% for x" + str(i) + " in messages %}" for i in range(12)) + "x" + "{% endfor %}" * 12 + "{{ messages }}"
HOSTILE = {
    "repeat": "{{ 'a' * 3000000000 }}", "power": "{{ 10 ** 100000000 }}", "center": "{{ 'a'|center(3000000000) }}",
    "ljust": "{{ 'a'.ljust(3000000000) }}", "printf": "{{ '%3000000000s' % 'a' }}", "format": "{{ '{:>3000000000}'.format(1) }}",
    "doubling": "{% set ns = namespace(s='aaaaaaaa') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "straight": "{% set a = 'aaaaaaaa' %}" + "{% set a = a + a %}" * 40,
    "macro": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('aaaaaaaa', 40) }}",
    "output": "{% for i in range(100000) %}{{ 'a' * 30000000 }}{% endfor %}",
    "replace": "{{ ('a' * 1000000)|replace('a', 'a' * 1000) }}",
    "join": "{{ (['a' * 30000000] * 100)|join }}", "str join": "{{ ''.join(['a' * 30000000] * 100) }}",
}


def test_ordinary_templates_render_as_transformers_renders_them():
    from transformers.utils.chat_template_utils import render_jinja_template

    expected, _ = render_jinja_template([MESSAGES], chat_template=ORDINARY, bos_token="<s>")
    assert render(ORDINARY, MESSAGES, bos_token="<s>") == expected[0]
    spans = "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}" \
            "{% else %}{{ m.content }}{% endif %}{% endfor %}"
    assert render_with_spans(spans, MESSAGES) == ("HiHello!", [(2, 8)])
    assert render("{{ (1712345678901 // 1000)|string }}{{ messages|tojson|length > 0 }}", MESSAGES) == "1712345678True"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_template_that_would_build_gigabytes_is_refused_before_it_allocates(name):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with time_limit(30), pytest.raises(TemplateBudget, match=f"longer than {MAX_CHARS:,} characters"):
        render(HOSTILE[name], MESSAGES)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # kB
    assert grown < 1_000_000, f"the peak grew by {grown / 1e6:.1f} GB"


@pytest.mark.parametrize("template", [LOOPS, NESTED], ids=["range", "messages"])
def test_loops_over_loops_stop_at_the_time_budget(template):
    with time_limit(30), pytest.raises(TemplateBudget, match="did not finish rendering this conversation in 0.2 s"):
        render(template, MESSAGES * 5, seconds=0.2)


def test_the_earlier_of_two_budgets_holds():
    with time_limit(30), pytest.raises(TemplateBudget, match="in 0.2 s"), budget.time_budget(0.2):
        render(LOOPS, MESSAGES, seconds=10)


@pytest.fixture
def hostile_tokenizer_dir(tiny_dir, tmp_path):
    """The built-in tiny model with `{{ 'a' * 3000000000 }}` as its own chat template."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").write_text(HOSTILE["repeat"])
    return folder


def test_chat_eval_and_tokenizing_render_within_the_budget(hostile_tokenizer_dir):
    from transformers import AutoTokenizer

    from finetune.data.formats import RowProblem
    from finetune.data.tokenize import RowError, tokenize_examples

    tokenizer = AutoTokenizer.from_pretrained(str(hostile_tokenizer_dir))
    with time_limit(30), pytest.raises(TemplateBudget):
        render_for(tokenizer, MESSAGES, add_generation_prompt=True)  # chat, reward eval
    with time_limit(30), pytest.raises((RowProblem, RowError), match="longer than"):
        tokenize_examples([{"messages": MESSAGES}], tokenizer, "messages", 64)  # data show, prepare, eval, training


def test_data_show_stops_a_template_that_loops(tmp_path, tiny_cache, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tiny_cache))
    monkeypatch.setattr(budget, "RENDER_SECONDS", 0.3)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text('model: {name_or_path: "builtin:tiny-llama"}\n'
                      f"data: {{path: chat.jsonl, format: messages, chat_template: {json.dumps(LOOPS)}}}\n")
    with time_limit(60):
        result = CliRunner().invoke(app, ["data", "show", str(recipe)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "chat.jsonl:1: " in result.output and "did not finish rendering this conversation in 0.3 s" in result.output


def test_dry_run_checks_the_tokenizers_own_template(hostile_tokenizer_dir, tmp_path, no_launch):
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{name_or_path: {hostile_tokenizer_dir}}}\ndata: {{path: chat.jsonl, format: messages}}\n"
                      f"output_dir: {tmp_path / 'out'}\n")
    with time_limit(120):
        result = CliRunner().invoke(app, ["train", str(recipe), "--dry-run"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output[-2000:]
    assert "error: the tokenizer's chat template: " in result.output and "chat.jsonl:1: the chat template builds" in result.output
    assert "all look right" in result.output  # the rows themselves are fine: only the template is refused
