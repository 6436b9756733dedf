"""OpenAI requests the engine would fail on as internal errors are refused as 400s naming the field."""

from __future__ import annotations

import json

import pytest
from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

from serve_apps.request_checks import MAX_NESTING_DEPTH, chat_request_problem, completion_request_problem


def _chat(raw: str) -> ChatCompletionRequest:
    # Parsed from JSON text as the ingress does: "\ud800" escapes become lone surrogates.
    return ChatCompletionRequest.model_validate(json.loads(raw))


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}],
    [{"role": "tool", "tool_call_id": "c", "content": "x"}, {"role": "developer", "content": "y"}],
    [{"role": "user", "content": [{"type": "text", "text": "fine \U0001F600"}]}],
    [{"role": "ipython", "content": "a custom role, handed to the chat template as vLLM does"}],
])
def test_well_formed_messages_pass(messages):
    assert chat_request_problem(_chat(json.dumps({"model": "m", "messages": messages}))) is None


@pytest.mark.parametrize("messages", [[{"content": "no role"}], [{"role": 7, "content": "x"}], [{"role": None}]])
def test_a_message_without_a_role_is_refused(messages):
    body = ChatCompletionRequest.model_construct(model="m", messages=messages)
    message, param = chat_request_problem(body)
    assert param == "messages[0].role" and "must be a string" in message


def test_a_content_part_of_an_unknown_type_names_the_part_and_the_types_there_are():
    body = _chat('{"model":"m","messages":[{"role":"user","content":"ok"},{"role":"user","content":[{"type":"bogus"}]}]}')
    message, param = chat_request_problem(body)
    assert param == "messages[1].content[0].type"
    assert message.startswith("messages[1].content[0].type: Input should be 'text', 'image_url'")


@pytest.mark.parametrize("raw, param, position", [
    ('{"model":"m","messages":[{"role":"user","content":"\\ud800"}]}', "messages[0].content", 0),
    ('{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"ok \\udc00"}]}]}',
     "messages[0].content[0].text", 3),
    ('{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":'
     '{"name":"f","description":"a\\ud800","parameters":{"type":"object"}}}]}', "tools[0].function.description", 1),
    # ASCII as sent; vLLM parses the arguments before the template renders them.
    ('{"model":"m","messages":[{"role":"user","content":"x"},{"role":"assistant","tool_calls":[{"id":"c",'
     '"type":"function","function":{"name":"f","arguments":"{\\"a\\": [\\"ok\\", \\"x\\\\ud800\\"]}"}}]}]}',
     "messages[1].tool_calls[0].function.arguments.a[1]", 1),
])
def test_text_utf8_cannot_encode_is_refused_where_it_is(raw, param, position):
    message, where = chat_request_problem(_chat(raw))
    assert where == param
    assert message.startswith(f"{param}: the text is not valid Unicode") and f"character {position}" in message


def test_a_key_utf8_cannot_encode_is_refused_without_being_echoed():
    """A tool schema's property names reach the template (`tojson`) like its values."""
    raw = ('{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":'
           '{"name":"f","parameters":{"type":"object","properties":{"ok\\ud800":{"type":"string"}}}}}]}')
    message, where = chat_request_problem(_chat(raw))
    assert where == "tools[0].function.parameters.properties"
    assert message.startswith(f"{where}: a key is not valid Unicode (a lone surrogate at character 2)")
    message.encode("utf-8")  # the answer itself can be sent


def test_a_surrogate_pair_is_text_like_any_other():
    assert chat_request_problem(_chat('{"model":"m","messages":[{"role":"user","content":"\\ud83d\\ude00"}]}')) is None


def test_a_completion_prompt_with_a_lone_surrogate_is_refused():
    body = CompletionRequest.model_validate(json.loads('{"model":"m","prompt":["a","b\\udfff"]}'))
    assert completion_request_problem(body)[1] == "prompt[1]"
    assert completion_request_problem(CompletionRequest.model_validate({"model": "m", "prompt": "fine"})) is None


def test_more_choices_than_openai_allows_are_refused():
    many = _chat('{"model":"m","messages":[{"role":"user","content":"x"}],"n":129}')
    assert chat_request_problem(many) == ("n must be at most 128, got 129", "n")
    assert chat_request_problem(_chat('{"model":"m","messages":[{"role":"user","content":"x"}],"n":128}')) is None
    prompt = CompletionRequest.model_validate({"model": "m", "prompt": "x", "n": 1000})
    assert completion_request_problem(prompt)[1] == "n"


@pytest.mark.parametrize("prompt, n, is_refused", [
    (["p"] * 1024, 128, True),  # 131,072 sequences from a 5 KB body and one token of the key's bucket
    ([[1, 2]] * 9, 128, True),  # token-id prompts count alike
    (["p"] * 8, 128, False),
    (["p"] * 1024, 1, False),
    ([1, 2, 3], 128, False),  # one prompt of token ids
])
def test_a_completion_batch_starts_at_most_max_sequences(prompt, n, is_refused):
    problem = completion_request_problem(CompletionRequest.model_validate({"model": "m", "prompt": prompt, "n": n}))
    if is_refused:
        assert problem[1] == "prompt" and "one request may start at most 1024" in problem[0]
    else:
        assert problem is None


def test_a_max_completion_tokens_under_one_is_refused_by_its_own_name():
    """vLLM copies it into `max_tokens` before its check, and refused it as `max_tokens`, which was not sent."""
    body = _chat('{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":0}')
    assert chat_request_problem(body) == ("max_completion_tokens must be at least 1, got 0", "max_completion_tokens")
    fine = _chat('{"model":"m","messages":[{"role":"user","content":"x"}],"max_completion_tokens":1}')
    assert chat_request_problem(fine) is None


@pytest.mark.parametrize("n, best_of, is_refused", [(None, None, False), (3, 3, False), (None, 1, False),
                                                   (None, 3, True), (3, 2, True)])
def test_a_best_of_the_engine_would_ignore_is_refused(n, best_of, is_refused):
    """vLLM's engine takes `best_of` and ignores it: `n: 1, best_of: 3` sampled one choice, `n: 3, best_of: 2`
    (which OpenAI's API refuses) three."""
    body = {"model": "m", "prompt": "x", **({"n": n} if n else {}), **({"best_of": best_of} if best_of else {})}
    problem = completion_request_problem(CompletionRequest.model_validate(body))
    assert (problem is not None and problem[1] == "best_of") is is_refused, problem


def _nested(depth: int) -> dict:
    deep = {"a": []}
    inner = deep["a"]
    for _ in range(depth - 2):
        inner.append([])
        inner = inner[0]
    return deep


@pytest.mark.parametrize("depth", [MAX_NESTING_DEPTH + 2, 500, 5000])
def test_a_free_form_field_nested_past_the_bound_is_a_400_not_a_500(depth):
    """Ray pickles a handle call's arguments, which fails from about 490 levels; JSON's parser takes about 970,
    and the walk alone stopped only where it ran out of frames: nested in between, the call failed, a 500."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    body.chat_template_kwargs = _nested(depth)
    assert chat_request_problem(body) == (
        f"chat_template_kwargs: nests arrays or objects more than {MAX_NESTING_DEPTH} levels deep", "chat_template_kwargs")
    body.chat_template_kwargs = _nested(MAX_NESTING_DEPTH)
    assert chat_request_problem(body) is None


def test_a_top_k_no_vocabulary_reaches_is_refused_naming_it():
    """vLLM bounds it below only; past 64 bits the message to its engine process failed, a 500."""
    huge = _chat('{"model":"m","messages":[{"role":"user","content":"x"}],"top_k":18446744073709551616}')
    message, param = chat_request_problem(huge)
    assert param == "top_k" and "got 18446744073709551616" in message
    assert chat_request_problem(_chat('{"model":"m","messages":[{"role":"user","content":"x"}],"top_k":50}')) is None


def test_a_detokenize_id_beyond_32_bits_is_refused_naming_it():
    from ray.llm._internal.serve.core.configs.openai_api_models import DetokenizeRequest

    from serve_apps.request_checks import detokenize_request_problem

    assert detokenize_request_problem(DetokenizeRequest(tokens=[0, 8191, 2**32 - 1])) is None
    message, param = detokenize_request_problem(DetokenizeRequest(tokens=[5, 59783278860121480]))
    assert param == "tokens[1]" and "59783278860121480 is not a token id" in message


def test_a_tokenize_prompt_with_a_lone_surrogate_is_refused():
    from ray.llm._internal.serve.core.configs.openai_api_models import TokenizeCompletionRequest

    from serve_apps.request_checks import tokenize_request_problem

    body = TokenizeCompletionRequest.model_validate(json.loads('{"model":"m","prompt":"a\\ud800"}'))
    assert tokenize_request_problem(body)[1] == "prompt"
    assert tokenize_request_problem(TokenizeCompletionRequest(model="m", prompt="fine")) is None


def test_a_tokenize_or_detokenize_model_with_a_lone_surrogate_is_refused():
    """An unknown model's 404 echoes its name, which the response could not encode: a 500."""
    from ray.llm._internal.serve.core.configs.openai_api_models import DetokenizeRequest, TokenizeCompletionRequest

    from serve_apps.request_checks import detokenize_request_problem, tokenize_request_problem

    tokenize = TokenizeCompletionRequest.model_validate(json.loads('{"model":"\\ud800","prompt":"hi"}'))
    detokenize = DetokenizeRequest.model_validate(json.loads('{"model":"\\ud800","tokens":[1]}'))
    assert tokenize_request_problem(tokenize)[1] == "model" and detokenize_request_problem(detokenize)[1] == "model"


@pytest.mark.parametrize("field, value, param", [
    ("stop", ["end", "x\ud800"], "stop[1]"),  # the message to the engine process fails to encode it
    ("bad_words", ["\ud800"], "bad_words[0]"),  # the tokenizer fails on it
    ("vllm_xargs", {"k": "\udfff"}, "vllm_xargs.k"),
    ("request_id", "r\ud800", "request_id"),
])
def test_text_utf8_cannot_encode_in_any_field_is_refused(field, value, param):
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **{field: value})
    problem = chat_request_problem(chat)
    assert problem is not None and problem[1] == param, problem
    completion = CompletionRequest(model="m", prompt="hi", **{field: value})
    assert completion_request_problem(completion)[1] == param
    # The same fields with valid text pass.
    clean = {"stop": ["end"], "bad_words": ["x"], "vllm_xargs": {"k": "v"}, "request_id": "r1"}[field]
    assert chat_request_problem(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      **{field: clean})) is None


@pytest.mark.parametrize("mode, is_refused", [("full", True), ("incremental", False), (None, False)])
def test_a_request_may_not_switch_the_engines_kv_events_to_full_reports(mode, is_refused):
    """Re-announced blocks would stay in the router's index after the engine evicted them."""
    xargs = {} if mode is None else {"kv_cache_report_mode": mode}
    chat = _chat(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "vllm_xargs": xargs}))
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "vllm_xargs": xargs})
    for problem in (chat_request_problem(chat), completion_request_problem(completion)):
        assert (problem is not None) is is_refused
        if is_refused:
            assert problem[1] == "vllm_xargs.kv_cache_report_mode" and "'full'" in problem[0]
