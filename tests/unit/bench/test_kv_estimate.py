"""The CPU KV capacity estimate divides the cache space as vLLM does: a float32 checkpoint runs (and caches)
in 16 bits unless `dtype` says otherwise, and `kv_cache_dtype` overrides both."""

from __future__ import annotations

import json

import pytest

from bench import live
from cluster.config import load_config

SHAPE = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "num_hidden_layers": 2}


@pytest.mark.parametrize("checkpoint_dtype, engine_kwargs, bytes_per_element", [
    ("bfloat16", {}, 2),
    ("float32", {}, 2),  # vLLM's `dtype: auto` runs a float32 checkpoint in 16 bits
    ("float32", {"dtype": "float32"}, 4),
    ("bfloat16", {"dtype": "float32"}, 4),
    ("float32", {"kv_cache_dtype": "fp8"}, 1),
])
def test_the_estimate_uses_the_dtype_vllm_caches_in(tmp_path, checkpoint_dtype, engine_kwargs, bytes_per_element):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "torch_dtype": checkpoint_dtype}))
    cfg = load_config(environ={}, overrides={"model": {"source": str(tmp_path)},
                                             "replicas": {"engine_kwargs": engine_kwargs}})
    bytes_per_block = 2 * 2 * 2 * 64 * bytes_per_element * cfg.replicas.block_size_tokens  # K and V, layers, heads, dim
    assert live.kv_capacity_blocks(cfg) == (cfg.replicas.kv_cache_space_gib << 30) // bytes_per_block
