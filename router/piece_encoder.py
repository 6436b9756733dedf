"""`PieceEncoder`: tokenizes a prompt piece by piece, reusing the pieces it has seen.

Why: every agent turn re-sends the whole history, and the router tokenizes each
prompt on the ingress's event loop (4.4 ms for a 5.8k-token prompt on one
core) although all but the newest messages were tokenized for the turn before.

Why it is exact: a Hugging Face tokenizer first splits the text at its added
tokens (`<|eot_id|>`, `<tool_call>`, ...), leftmost and longest match first,
and only then pre-tokenizes and runs BPE on each piece between them, on its
own. So encoding each piece separately, caching pieces by their text, gives
the ids of encoding the whole text, provided that:
- no added token eats the whitespace beside it (`lstrip`, `rstrip`) or
  matches only whole words (`single_word`);
- no normalizer runs (it could change which text an added token matches);
- added tokens are matched at all (`split_special_tokens` is off);
- no pre-tokenizer treats the text's first piece apart from the others: a
  `Metaspace` one (SentencePiece tokenizers converted to fast ones, Llama 2 and
  Mistral) puts its "▁" before the first piece only, unless its
  `prepend_scheme` is "never", so a piece after an added token encodes
  differently on its own;
- no special tokens are added around the text (`add_special_tokens=False`,
  which is how vLLM encodes rendered chat prompts).
`PieceEncoder.for_tokenizer` returns None when the tokenizer breaks one of the
first four, or when texts around its added tokens encode differently piece by
piece than whole (a check of the rules on the tokenizer itself); callers then
encode whole texts.

Cached pieces are bounded by their total characters (least recently used
first out), ids kept as 4-byte arrays: at the default bound about 8 MiB of text
and 8 MiB of ids (byte-level BPE averages 3-4 characters per token). The lock
makes one encoder safe to share between threads.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Mapping, Optional

DEFAULT_MAX_CACHED_CHARS = 8 * 1024 * 1024
# How many of a tokenizer's added tokens `for_tokenizer` checks texts around.
NUM_PROBED_ADDED_TOKENS = 4
# Texts around an added token `t` that `for_tokenizer` encodes both ways: text before and after it, at the
# start and the end, spaces and newlines beside it.
_PROBE_TEMPLATES = ("{t}Hello world{t} how are you", "hello {t} World\n\n{t}\nyes", " {t}  x{t}")


class PieceEncoder:
    """Encodes texts as cached pieces between added tokens (see module docstring)."""

    def __init__(
        self,
        encode_piece: Callable[[str], list[int]],
        added_token_ids: Mapping[str, int],
        max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS,
    ) -> None:
        """Args:
        encode_piece: ids of a text holding no added token, no special tokens added.
        added_token_ids: every added token's text -> its id.
        max_cached_chars: bound on the total length of cached pieces.
        """
        if not added_token_ids:
            raise ValueError("a tokenizer without added tokens has no pieces to cache")
        if max_cached_chars < 0:
            raise ValueError(f"max_cached_chars must be >= 0, got {max_cached_chars}")
        self._encode_piece = encode_piece
        self._added_token_ids = dict(added_token_ids)
        # Longest first: a regex alternation takes the first alternative that matches at the
        # leftmost position, which is then the longest, as the tokenizer's own matcher does.
        alternatives = sorted(self._added_token_ids, key=len, reverse=True)
        self._added_token = re.compile("|".join(re.escape(t) for t in alternatives))
        self._max_cached_chars = max_cached_chars
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> Optional["PieceEncoder"]:
        """An encoder for a `transformers` fast tokenizer, or None if pieces would not encode alike."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(tokenizer, "added_tokens_decoder", None)
        if backend is None or not added or backend.normalizer is not None:
            return None
        if getattr(tokenizer, "split_special_tokens", False):
            return None
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None
        if _has_first_piece_rule(getattr(backend, "pre_tokenizer", None)):
            return None

        def encode_piece(text: str) -> list[int]:
            return backend.encode(text, add_special_tokens=False).ids

        added_token_ids = {t.content: i for i, t in added.items()}
        if not cls(encode_piece, added_token_ids, max_cached_chars=0).encodes_like(tokenizer):
            return None
        return cls(encode_piece, added_token_ids, max_cached_chars)

    def encodes_like(self, tokenizer: Any) -> bool:
        """Whether texts around the first few added tokens encode as `tokenizer` encodes them whole.

        Why: the rules in the module docstring are what the encoder knows of;
        this catches a tokenizer that breaks one it does not.
        """
        probed = sorted(self._added_token_ids, key=self._added_token_ids.__getitem__)[:NUM_PROBED_ADDED_TOKENS]
        texts = [template.format(t=token) for token in probed for template in _PROBE_TEMPLATES]
        return all(self.encode(text) == list(tokenizer.encode(text, add_special_tokens=False)) for text in texts)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, as the tokenizer encodes it without adding special tokens."""
        ids: list[int] = []
        start = 0
        for match in self._added_token.finditer(text):
            if match.start() > start:
                ids += self._piece(text[start:match.start()])
            ids.append(self._added_token_ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    @property
    def num_cached_pieces(self) -> int:
        return len(self._pieces)

    def _piece(self, piece: str) -> array:
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                return ids
        ids = array("I", self._encode_piece(piece))
        if len(piece) > self._max_cached_chars:
            return ids
        with self._lock:
            if piece not in self._pieces:
                self._pieces[piece] = ids
                self._cached_chars += len(piece)
                while self._cached_chars > self._max_cached_chars:
                    evicted, _ = self._pieces.popitem(last=False)
                    self._cached_chars -= len(evicted)
        return ids


def _has_first_piece_rule(pre_tokenizer: Any) -> bool:
    """Whether a `tokenizers` pre-tokenizer treats a text's first piece apart (a `Metaspace` that prepends
    its replacement), looking inside sequences of pre-tokenizers; True for one it cannot read."""
    if pre_tokenizer is None:
        return False
    try:
        state = json.loads(pre_tokenizer.__getstate__())
    except Exception:
        return True
    return _state_has_first_piece_rule(state)


def _state_has_first_piece_rule(state: Any) -> bool:
    if not isinstance(state, dict):
        return False
    if state.get("type") == "Metaspace" and state.get("prepend_scheme") != "never":
        return True
    return any(_state_has_first_piece_rule(inner) for inner in state.get("pretokenizers") or ())
