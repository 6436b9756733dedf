"""The orchestrator renders prompts as the replicas do: with their server-side chat template and default
template arguments (`replicas.engine_kwargs`)."""

from __future__ import annotations

import copy

import pytest

from serve_apps.orchestrator.models import Message
from serve_apps.orchestrator.prompt import SessionState, build_chat_request, control_tokens_of, count_tokens
from serve_apps.orchestrator.served_template import ServedTemplateTokenizer, served_tokenizer
from tests.unit.orchestrator.test_turns import CharTokenizer

SERVER_TEMPLATE = (
    "{%- for m in messages %}[{{ m['role'] }}{{ '!' if shout else '' }}]{{ m['content'] }}{%- endfor %}"
    "{%- if add_generation_prompt %}[assistant]{%- endif %}"
)


class JinjaTokenizer(CharTokenizer):
    """One token per character, rendering whatever template it is given (its own is CharTokenizer's)."""

    chat_template = "own"

    def apply_chat_template(self, conversation, tools=None, tokenize=False, add_generation_prompt=False,
                            chat_template=None, **template_kwargs):
        if chat_template is None:
            return super().apply_chat_template(conversation, tools, tokenize, add_generation_prompt)
        import jinja2

        text = jinja2.Template(chat_template).render(messages=conversation, tools=tools,
                                                     add_generation_prompt=add_generation_prompt, **template_kwargs)
        return [ord(c) for c in text] if tokenize else text


def _total(tokenizer) -> tuple[int, str]:
    messages, tools = build_chat_request(SessionState("Be brief.", (), (Message(role="user", content="hi"),)))
    account = count_tokens(tokenizer, messages, tools, context_window_tokens=4096, output_reserve_tokens=16)
    return account.total_tokens, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_without_server_settings_the_tokenizer_is_the_models_own():
    tokenizer = JinjaTokenizer()
    assert served_tokenizer(tokenizer, {"max_num_seqs": 8}) is tokenizer


def test_a_server_template_and_its_default_arguments_are_what_the_orchestrator_counts(tmp_path):
    """Counted with the tokenizer's own template, every step's figures were another prompt's."""
    template_file = tmp_path / "tool_template.jinja"
    template_file.write_text(SERVER_TEMPLATE)
    for setting in (str(template_file), SERVER_TEMPLATE):  # a file, as vLLM reads it, or the template itself
        served = served_tokenizer(JinjaTokenizer(), {"chat_template": setting,
                                                     "default_chat_template_kwargs": {"shout": True}})
        total, text = _total(served)
        assert text == "[system!]Be brief.[user!]hi[assistant]" and total == len(text)
        assert served.chat_template == SERVER_TEMPLATE
    # A request's own arguments win over the server's defaults, as in vLLM.
    assert "[user]" in served.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, shout=False)


def test_the_served_tokenizer_copies_and_keys_the_control_token_cache():
    served = served_tokenizer(JinjaTokenizer(), {"default_chat_template_kwargs": {"shout": True}})
    assert isinstance(served, ServedTemplateTokenizer)
    assert isinstance(copy.deepcopy(served), ServedTemplateTokenizer)  # the session checks' own copy
    control_tokens_of(served)  # weakly keyed by the tokenizer it is given


def test_a_template_named_as_vllm_names_its_built_in_ones_is_that_template():
    """The replicas load vLLM's built-in ChatML for `template_chatml.jinja`; read as the template's own text,
    the name was every prompt the orchestrator counted."""
    from vllm.transformers_utils.chat_templates.registry import CHAT_TEMPLATES_DIR

    served = served_tokenizer(JinjaTokenizer(), {"chat_template": "template_chatml.jinja"})
    assert served.chat_template == (CHAT_TEMPLATES_DIR / "template_chatml.jinja").read_text()
    with pytest.raises(ValueError, match="looks like a file path"):  # as it fails every replica
        served_tokenizer(JinjaTokenizer(), {"chat_template": "no_such_template.jinja"})
