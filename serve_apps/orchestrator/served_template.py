"""The model's tokenizer rendering chat prompts as the replicas' vLLM frontend renders them.

Why: the orchestrator counts each step's tokens, and finds the session's cached
prefix, by rendering the prompt itself (`serve_apps.orchestrator.prompt`). A
deployment may give the replicas a server-side chat template (vLLM's
`--chat-template`, here `replicas.engine_kwargs.chat_template`: vLLM's own tool
templates for Llama's JSON calls, DeepSeek, Gemma) and default template
arguments (`default_chat_template_kwargs`: Qwen3's `enable_thinking: false`).
Rendered with the tokenizer's own template and none of the arguments, the
counts were another prompt's: the window check, the compression plan and the
prefix fingerprint were wrong for every step.
"""

from __future__ import annotations

from typing import Any, Mapping


class ServedTemplateTokenizer:
    """A tokenizer whose `apply_chat_template` uses the server's template and default arguments (a request's own
    arguments win, as in vLLM); everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, chat_template: str | None, template_kwargs: Mapping[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._template_kwargs = dict(template_kwargs)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template if self._chat_template is not None else self._tokenizer.chat_template

    def apply_chat_template(self, conversation, **kwargs):
        if self._chat_template is not None:
            kwargs.setdefault("chat_template", self._chat_template)
        return self._tokenizer.apply_chat_template(conversation, **{**self._template_kwargs, **kwargs})

    def __call__(self, text, **kwargs):
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        tokenizer = self.__dict__.get("_tokenizer")  # absent while `copy` builds one
        if tokenizer is None:
            raise AttributeError(name)
        return getattr(tokenizer, name)


def served_tokenizer(tokenizer: Any, engine_kwargs: Mapping[str, Any]) -> Any:
    """`tokenizer` as the replicas render with `engine_kwargs` (`replicas.engine_kwargs`); itself where they set
    neither a chat template nor default template arguments.

    The `chat_template` is read by vLLM's own loader, as the replicas read it: a readable file's text, else one
    of vLLM's built-in templates by name (`template_chatml.jinja`), else the template itself where it holds
    `{`, `}` or a line break; a name that is none of these raises ValueError, as it fails the replicas. A file
    must be readable where the orchestrator runs too (the same image on Kubernetes).
    """
    template = engine_kwargs.get("chat_template")
    template_kwargs = engine_kwargs.get("default_chat_template_kwargs") or {}
    if template is None and not template_kwargs:
        return tokenizer
    if template is not None:
        from vllm.renderers.chat_utils import load_chat_template

        try:
            template = load_chat_template(str(template))
        except Exception as err:  # vLLM's own error class, no ValueError
            raise ValueError(f"replicas.engine_kwargs.chat_template: {err}") from None
    return ServedTemplateTokenizer(tokenizer, template, template_kwargs)
