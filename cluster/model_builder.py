"""Builds the small Llama-architecture model the CPU cluster serves.

Why: no weights can be downloaded on CI or a laptop without a hub, yet every
part of the stack (tokenizer, chat template with tools, prefix caching, KV
events, structured outputs) must run against a real checkpoint. The weights are
random, so the text is gibberish, but prompt structure and prefill cost are real.

Determinism: the tokenizer is trained on a fixed, sorted list of files from the
Python standard library that ships with this interpreter, and the weights come
from a seeded generator, so the same seed and Python build give byte-identical
files (`manifest.json` lists their sha256).

The chat template renders what agents send: a system prompt, the tool schemas
(hermes-style `<tools>` block), user turns, assistant tool calls as
`<tool_call>{...}</tool_call>` (which vLLM's `hermes` tool parser reads back)
and tool results as `<tool_response>` blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, HEADER_START, HEADER_END, EOT, "<|pad|>"]
# A file every build writes first: the folder is this builder's to rewrite.
BUILD_MARKER = ".warmpath-build"
# Markup the hermes tool parser looks up as single tokens.
TOOL_TOKENS = ["<tools>", "</tools>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
    "{%- if system or tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n# Tools\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start_header_id|>tool<|end_header_id|>\\n<tool_response>' + (message['content'] if message['content'] is string else message['content'] | tojson) + '</tool_response><|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n' }}"
    "{%- if message['content'] %}"
    "{{- message['content'] if message['content'] is string else message['content'] | map(attribute='text') | join('') }}"
    "{%- endif %}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the built model (~12.6M parameters): a 2k-token prefill costs seconds on 2 CPU cores, a cache hit ~0.1 s."""

    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    max_position_embeddings: int = 8192


def _corpus_files(max_bytes: int) -> list[Path]:
    """Sorted standard-library sources up to `max_bytes`: same interpreter, same corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        files.append(path)
        total += size
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return files


def _train_tokenizer(shape: ModelShape, corpus_bytes: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def lines():
        for path in _corpus_files(corpus_bytes):
            yield path.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token="<|pad|>",
        additional_special_tokens=[EOS, HEADER_START, HEADER_END],
        model_max_length=shape.max_position_embeddings,
    )
    # Not special: they must survive detokenisation so the tool parser sees them.
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_weights(shape: ModelShape, tokenizer, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOS)],
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def build_model(
    out_dir: Path,
    seed: int = 0,
    shape: ModelShape = ModelShape(),
    corpus_bytes: int = 8_000_000,
    progress: Callable[[str], None] = lambda _msg: None,
) -> dict:
    """Writes tokenizer, chat template, config and random weights to `out_dir`.

    Args:
        out_dir: target folder (created; existing files are overwritten).
        seed: weight initialisation seed.
        shape: model sizes.
        corpus_bytes: how much standard-library source trains the tokenizer.
        progress: called with one line per step.

    Returns:
        The manifest written to `out_dir/manifest.json` (file name -> sha256, sizes).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    before = _file_stamps(out_dir)  # what was there: the files this build writes are new or rewritten
    # Written first and kept, so a build that stops part way is still known as this builder's folder.
    (out_dir / BUILD_MARKER).write_text("written by warmpath build-model; its files are rewritten by the next build\n")
    # Written last, so a build that stops part way (Ctrl-C, a full disk) never counts as built.
    (out_dir / "manifest.json").unlink(missing_ok=True)
    progress(f"training byte-level BPE tokenizer (vocab {shape.vocab_size}) on standard-library sources")
    tokenizer = _train_tokenizer(shape, corpus_bytes)
    tokenizer.save_pretrained(out_dir)
    progress(
        f"initialising Llama weights (seed {seed}, {shape.num_layers} layers, hidden {shape.hidden_size})"
    )
    model = _build_weights(shape, tokenizer, seed)
    num_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out_dir, safe_serialization=True)
    # Generation defaults from a random model would only confuse clients.
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    files = {
        p.name: _sha256(p)
        for p in sorted(out_dir.iterdir())
        if p.is_file() and p.name not in ("manifest.json", BUILD_MARKER) and before.get(p.name) != _stamp(p)
    }
    _readable_as_umask_allows([out_dir / name for name in (*files, BUILD_MARKER)])
    manifest = {"seed": seed, "num_params": num_params, "shape": shape.__dict__, "files": files}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    progress(f"wrote {len(files)} files ({num_params / 1e6:.1f}M parameters) to {out_dir}")
    return manifest


def _readable_as_umask_allows(paths: Iterable[Path]) -> None:
    """Gives the files the build wrote the mode the umask allows: the weights were saved 0600 (by the
    safetensors writer), so a model built for another user to serve (a service account, a container's
    user) could not be read by it. Only those files: `--force` may build where other files are."""
    mode = 0o666 & ~_umask()
    for path in paths:
        path.chmod(mode)


def _stamp(path: Path) -> tuple[int, int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _file_stamps(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {path.name: _stamp(path) for path in folder.iterdir() if path.is_file()}


def _umask() -> int:
    """The process's umask, read without setting it (Linux says it in /proc; elsewhere it is set back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def is_rebuildable(out_dir: Path) -> bool:
    """Whether building into `out_dir` overwrites nothing but an earlier build: it is missing or empty, or a
    build (finished or stopped part way) wrote it. A model folder of the user's own is not: a build
    rewrites its weights, config and tokenizer and deletes its `generation_config.json`."""
    if not out_dir.is_dir():
        return not out_dir.exists()
    return (out_dir / BUILD_MARKER).is_file() or _has_builders_manifest(out_dir) or not any(out_dir.iterdir())


def _has_builders_manifest(out_dir: Path) -> bool:
    """A manifest as `build_model` writes it (builds from before the marker have no marker)."""
    try:
        manifest = json.loads((out_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and {"seed", "shape", "files"} <= manifest.keys()


def is_built(out_dir: Path) -> bool:
    """True when a previous build completed (its manifest is written last)."""
    return (out_dir / "manifest.json").is_file() and (out_dir / "config.json").is_file()
