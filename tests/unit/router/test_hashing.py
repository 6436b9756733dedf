"""router.hashing: the fixed encoding, full blocks only, chaining, laziness and reuse."""

from __future__ import annotations

import subprocess
import sys
from array import array

import pytest

from router.hashing import (
    RequestBlockHashes,
    as_token_array,
    hash_block_tokens,
    hash_request_blocks,
    root_hash,
)

ROOT = root_hash("warmpath-tiny", None)


def reference_chain(tokens: list[int], block_size: int, root: bytes) -> list[bytes]:
    out, parent = [], root
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size])
        out.append(parent)
    return out


@pytest.mark.parametrize(
    ("model_id", "cache_salt", "parent_tokens", "expected_hex"),
    [
        # Golden values: a change here is a change of the wire-independent hash format.
        ("warmpath-tiny", None, None, "1abd66595b0b7c2d25303b28a36fb7eb"),
        ("warmpath-tiny", "salt", None, "82d1e70e469f127ef40688806b1c264d"),
        ("warmpath-tiny", None, list(range(32)), "0e3e7f69eee024ed4df608021d5dae53"),
    ],
)
def test_known_answers(model_id, cache_salt, parent_tokens, expected_hex):
    root = root_hash(model_id, cache_salt)
    digest = root if parent_tokens is None else hash_block_tokens(root, parent_tokens)
    assert digest.hex() == expected_hex


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("m", None), ("m", "")),  # no salt differs from an empty salt
        (("m", None), ("n", None)),
        (("m", "s1"), ("m", "s2")),
        (("ab", "c"), ("a", "bc")),  # length-prefixed: no ambiguity across fields
    ],
)
def test_roots_differ(a, b):
    assert root_hash(*a) != root_hash(*b)


@pytest.mark.parametrize("block_size", [1, 4, 32])
@pytest.mark.parametrize("num_tokens", [0, 1, 31, 32, 33, 64, 100])
def test_request_blocks_match_reference_and_skip_partial_tail(block_size, num_tokens):
    tokens = [(7 * i + 3) % 5000 for i in range(num_tokens)]
    hashes = hash_request_blocks(tokens, block_size, ROOT)
    assert len(hashes) == num_tokens // block_size
    assert hashes == reference_chain(tokens, block_size, ROOT)
    assert all(len(h) == 16 for h in hashes)


@pytest.mark.parametrize(
    ("changed_index", "num_equal_blocks"),
    [(0, 0), (5, 1), (11, 2), (12, 3), (15, 3)],
)
def test_a_token_change_changes_its_block_and_every_later_block(changed_index, num_equal_blocks):
    base = list(range(16))
    other = list(base)
    other[changed_index] += 1000
    a, b = hash_request_blocks(base, 4, ROOT), hash_request_blocks(other, 4, ROOT)
    equal = [x == y for x, y in zip(a, b)]
    assert equal == [True] * num_equal_blocks + [False] * (4 - num_equal_blocks)


@pytest.mark.parametrize(
    ("keys_a", "keys_b"),
    [((), ("lora-a",)), (("lora-a",), ("lora-b",)), (("ab", "c"), ("a", "bc"))],
)
def test_extra_keys_are_part_of_the_hash(keys_a, keys_b):
    tokens = list(range(4))
    assert hash_block_tokens(ROOT, tokens, keys_a) != hash_block_tokens(ROOT, tokens, keys_b)


def test_none_parent_is_the_zero_parent():
    assert hash_block_tokens(None, [1, 2]) == hash_block_tokens(bytes(16), [1, 2])


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_outside_u32_raise(bad):
    with pytest.raises(ValueError):
        as_token_array(bad)


def test_hashes_are_identical_in_another_process():
    code = (
        "from router.hashing import hash_request_blocks, root_hash;"
        "print(','.join(h.hex() for h in hash_request_blocks(range(100), 32, root_hash('m', 's'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    expected = ",".join(h.hex() for h in hash_request_blocks(range(100), 32, root_hash("m", "s")))
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("num_consumed", [0, 1, 3, 8])
def test_lazy_hashes_compute_only_what_is_consumed(num_consumed):
    tokens = array("I", range(32))
    blocks = RequestBlockHashes(tokens, 4, ROOT)
    consumed = [h for _, h in zip(range(num_consumed), blocks)]
    assert len(blocks.computed) == num_consumed
    assert consumed == hash_request_blocks(tokens, 4, ROOT)[:num_consumed]
    assert blocks.hashes() == hash_request_blocks(tokens, 4, ROOT)
    assert list(blocks) == blocks.hashes()


@pytest.mark.parametrize(
    ("previous", "current", "root", "num_reused"),
    [
        (list(range(16)), list(range(16)), ROOT, 4),
        (list(range(16)), list(range(26)), ROOT, 4),  # next turn extends the last one
        (list(range(26)), list(range(16)), ROOT, 4),  # shorter prompt: only its own blocks
        (list(range(16)), list(range(9)) + [999] + list(range(10, 16)), ROOT, 2),
        (list(range(16)), [999] + list(range(1, 16)), ROOT, 0),
        (list(range(16)), list(range(16)), root_hash("other", None), 0),
    ],
)
def test_reuse_prefix_takes_over_only_blocks_with_equal_tokens(previous, current, root, num_reused):
    old = RequestBlockHashes(previous, 4, ROOT)
    old.hashes()
    new = RequestBlockHashes(current, 4, root)
    assert new.reuse_prefix(old) == num_reused
    assert new.hashes() == hash_request_blocks(current, 4, root)


def test_an_iterator_survives_the_list_being_completed_under_it():
    blocks = RequestBlockHashes(range(32), 4, ROOT)
    iterator = iter(blocks)
    first = [next(iterator), next(iterator)]
    assert blocks.hashes() == hash_request_blocks(range(32), 4, ROOT)
    assert first + list(iterator) == blocks.hashes()
    assert len(blocks.computed) == 8
