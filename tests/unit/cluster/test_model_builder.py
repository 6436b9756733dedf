"""The built model is deterministic and has the structure agent prompts need."""

from pathlib import Path

import pytest

from cluster.model_builder import TOOL_TOKENS, ModelShape, build_model, is_built

SMALL = ModelShape(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                   max_position_embeddings=1024)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("model-a")
    return out, build_model(out, seed=7, shape=SMALL, corpus_bytes=300_000)


def test_same_seed_same_files(built, tmp_path: Path):
    _, first = built
    second = build_model(tmp_path, seed=7, shape=SMALL, corpus_bytes=300_000)
    assert first["files"] == second["files"]


def test_every_file_is_readable_as_the_umask_allows(built):
    """The weights were written 0600: a model built for another user to serve could not be read by it."""
    import os

    out, _ = built
    umask = os.umask(0)
    os.umask(umask)
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: 0o666 & ~umask for p in out.iterdir()}


def test_files_the_build_did_not_write_keep_their_mode_and_stay_out_of_the_manifest(tmp_path: Path):
    """With `--force` into a folder holding other files, a 0600 secret there became world-readable."""
    secret = tmp_path / "token.txt"
    secret.write_text("hf_xxx")
    secret.chmod(0o600)
    manifest = build_model(tmp_path, seed=7, shape=SMALL, corpus_bytes=300_000)
    assert secret.stat().st_mode & 0o777 == 0o600 and "token.txt" not in manifest["files"]


def test_a_build_marks_its_folder_as_its_own(built):
    from cluster.model_builder import BUILD_MARKER, is_rebuildable

    out, manifest = built
    assert (out / BUILD_MARKER).is_file() and BUILD_MARKER not in manifest["files"]
    assert is_rebuildable(out)


def test_other_seed_other_weights(built, tmp_path: Path):
    _, first = built
    other = build_model(tmp_path, seed=8, shape=SMALL, corpus_bytes=300_000)
    assert other["files"]["model.safetensors"] != first["files"]["model.safetensors"]
    assert other["files"]["tokenizer.json"] == first["files"]["tokenizer.json"]


def test_chat_template_renders_tools_calls_and_results(built):
    from transformers import AutoTokenizer

    out, _ = built
    assert is_built(out)
    tok = AutoTokenizer.from_pretrained(out)
    tools = [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"id": 1}}}]},
        {"role": "tool", "content": "RESULT-42"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.index("SYS") < text.index("<tools>") < text.index('"lookup"') < text.index("U1")
    assert '<tool_call>{"name": "lookup", "arguments": {"id": 1}}</tool_call>' in text
    assert "<tool_response>RESULT-42</tool_response>" in text
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n")
    for token in TOOL_TOKENS:  # single tokens, so vLLM's hermes parser finds them
        assert len(tok.encode(token, add_special_tokens=False)) == 1


def test_a_rebuild_that_stops_part_way_no_longer_counts_as_built(tmp_path: Path, monkeypatch):
    from cluster import model_builder

    build_model(tmp_path, seed=7, shape=SMALL, corpus_bytes=300_000)
    assert is_built(tmp_path)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_builder, "_build_weights", full_disk)
    with pytest.raises(OSError):
        build_model(tmp_path, seed=7, shape=SMALL, corpus_bytes=300_000)
    assert not is_built(tmp_path)  # `up` rebuilds instead of serving a half-written model
