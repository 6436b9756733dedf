"""router.piece_encoder: the same ids as encoding whole texts, with pieces reused and bounded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.workload_render import openai_request
from bench.workloads import WORKLOAD_NAMES, generate
from cluster.model_builder import ModelShape, build_model
from router.piece_encoder import PieceEncoder

SMALL = ModelShape(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                   max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("model")
    build_model(out, seed=3, shape=SMALL, corpus_bytes=300_000)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture()
def encoder(tokenizer) -> PieceEncoder:
    encoder = PieceEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    return encoder


def _whole(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_every_workload_prompt_encodes_as_the_whole_text_does(tokenizer, encoder, name):
    workload = generate(name, 5, 2, num_sessions=3)
    for session in workload.sessions:
        for step_index in range(len(session.steps)):
            messages, tools = openai_request(session, step_index)
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
            assert encoder.encode(text) == _whole(tokenizer, text)
    assert encoder.num_cached_pieces > 0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<|eot_id|>",
        "<|eot_id|><|eot_id|>",
        "  <tool_call> spaced </tool_call>  ",
        "user text naming <tool_call> and <tool_ inside it",
        "<tool_response>{\"a\": 1}</tool_response>\n\n<|start_header_id|>assistant<|end_header_id|>\n",
        "héllo wörld \U0001f600 <|eot_id|>\ttabs\n\nnewlines",
        "<|begin_of_text|<|eot_id|>|>",  # a broken token next to a whole one
    ],
)
def test_edge_texts_encode_as_the_whole_text_does(tokenizer, encoder, text):
    assert encoder.encode(text) == _whole(tokenizer, text)
    assert encoder.encode(text) == _whole(tokenizer, text)  # again, from the cache


def test_seen_pieces_are_not_encoded_again():
    calls = []

    def encode_piece(text):
        calls.append(text)
        return [ord(c) for c in text]

    encoder = PieceEncoder(encode_piece, {"<s>": 1, "<s><s>": 2})
    assert encoder.encode("ab<s>cd<s><s>ab") == [97, 98, 1, 99, 100, 2, 97, 98]  # longest token first
    assert calls == ["ab", "cd"]
    encoder.encode("cd<s>ef")
    assert calls == ["ab", "cd", "ef"]


def test_cached_pieces_stay_within_their_character_bound():
    encoder = PieceEncoder(lambda text: [len(text)], {"|": 0}, max_cached_chars=10)
    encoder.encode("aaaa|bbbb|cccc")  # 12 characters of pieces: the oldest goes
    assert encoder.num_cached_pieces == 2
    encoder.encode("x" * 11)  # longer than the bound: encoded, never cached
    assert encoder.num_cached_pieces == 2


def _fake_tokenizer(**token_flags):
    flags = {"lstrip": False, "rstrip": False, "single_word": False} | token_flags
    token = SimpleNamespace(content="<x>", **flags)
    return SimpleNamespace(backend_tokenizer=SimpleNamespace(normalizer=None), added_tokens_decoder={7: token})


@pytest.mark.parametrize(
    "tokenizer",
    [
        _fake_tokenizer(rstrip=True),
        _fake_tokenizer(lstrip=True),
        _fake_tokenizer(single_word=True),
        SimpleNamespace(backend_tokenizer=SimpleNamespace(normalizer=object()),
                        added_tokens_decoder=_fake_tokenizer().added_tokens_decoder),
        SimpleNamespace(**vars(_fake_tokenizer()), split_special_tokens=True),
        SimpleNamespace(backend_tokenizer=SimpleNamespace(normalizer=None), added_tokens_decoder={}),
    ],
)
def test_tokenizers_whose_pieces_would_encode_differently_get_no_encoder(tokenizer):
    assert PieceEncoder.for_tokenizer(tokenizer) is None


def _metaspace_tokenizer(prepend_scheme: str):
    """A SentencePiece-style fast tokenizer (Llama 2, Mistral) with two added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend_scheme)
    backend.train_from_iterator(["hello world how are you today " * 50],
                                trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    return tokenizer


@pytest.mark.parametrize("prepend_scheme", ["first", "always"])
def test_a_tokenizer_that_marks_the_first_piece_gets_no_encoder(prepend_scheme):
    assert PieceEncoder.for_tokenizer(_metaspace_tokenizer(prepend_scheme)) is None


def test_a_metaspace_tokenizer_that_never_prepends_encodes_piecewise_as_whole():
    tokenizer = _metaspace_tokenizer("never")
    encoder = PieceEncoder.for_tokenizer(tokenizer)
    assert encoder is not None
    text = "[INST]hello world[/INST] how are you[INST]"
    assert encoder.encode(text) == _whole(tokenizer, text)


def test_a_tokenizer_whose_pieces_encode_otherwise_than_whole_texts_gets_no_encoder():
    """No rule the encoder knows of is broken, but the check on texts around added tokens catches it."""
    ids = {"a": 1, "b": 2}

    def encode(text, add_special_tokens=False):
        return [ids.get(c, 0) for c in text] + [9]  # the whole text ends in one more id than its pieces

    tokenizer = SimpleNamespace(
        **vars(_fake_tokenizer()), encode=encode,
    )
    tokenizer.backend_tokenizer = SimpleNamespace(
        normalizer=None, pre_tokenizer=None,
        encode=lambda text, add_special_tokens=False: SimpleNamespace(ids=[ids.get(c, 0) for c in text]),
    )
    assert PieceEncoder.for_tokenizer(tokenizer) is None
    tokenizer.encode = lambda text, add_special_tokens=False: PieceEncoder(
        lambda piece: [ids.get(c, 0) for c in piece], {"<x>": 7}).encode(text)
    assert PieceEncoder.for_tokenizer(tokenizer) is not None
