"""Model directories: weights as safetensors, everything else as JSON, the encoder's config and tokenizer
as Hugging Face files. Loading never unpickles anything.

    model/weights.safetensors   every parameter and buffer of the XMCModel (label clusters included);
                                floating-point ones in the config's storage_dtype (float32, float16 or
                                bfloat16), integer ones as they are
    model/labels.json           the label names, in label-id order
    model/model.json            schema, config, shapes, encoder parameters, the storage dtype, and the size
                                and sha256 of every other file of the directory ("files")
    model/encoder/              the encoder's Hugging Face config and tokenizer
    model/label_info.json       the labels' texts (or null), training-document counts and inverse propensities
                                (xmcbench.labels), for components that read them
    model/components/NAME/      files a component writes beyond its tensors (LifecycleEvents.save_files), e.g.
                                an approximate-nearest-neighbour label index

Half-precision storage only shrinks the file: loading upcasts every weight to the model's float32, so a
loaded model computes as before, with weights rounded to the storage dtype.

Loading checks the directory before trusting it: a truncated, damaged, tampered or mismatched file, a
missing one, a model.json from a newer xmcbench, or a component no installed plugin provides each end in
one XmcError line naming the file, what is wrong and what to do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import shutil
from pathlib import Path, PurePosixPath

import torch
from safetensors.torch import _remove_duplicate_names, load_model, save_file

import xmcbench
from xmcbench.config import TrainConfig
from xmcbench.errors import DamagedModel, RefusedSetting, UnknownName, XmcError, joined_line
from xmcbench.interfaces import LabelClusters, LabelInfo, Retriever, call_factory, declared_keywords, \
    overrides, tree_level_clusters
from xmcbench.labels import load_label_info, save_label_info
from xmcbench.model import TreeLevel, XMCModel
from xmcbench.registry import Registry
from xmcbench.storage import atomic_write, read_json, write_json

SCHEMA_VERSION = 1
ENCODER_FOLDER = "encoder"
COMPONENTS_FOLDER = "components"   # files of components beyond their tensors (LifecycleEvents.save_files)
REQUIRED_KEYS = ("schema", "config", "num_labels", "num_clusters", "cluster_size", "encoder_params", "files")
SELF_CHECKSUM = "model_json_sha256"
REDO = "re-run training or copy the model directory again"
MAX_HEADER_BYTES = 100_000_000   # safetensors' own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
# the storage_dtype setting's values; directories saved before it existed hold float32 weights
STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_STORAGE_DTYPE = "float32"
SAFETENSORS_DTYPES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
                      torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float32: "F32", torch.float64: "F64"}


def build_model(registry: Registry, config: TrainConfig, clusters: LabelClusters,
                encoder_params: dict | None = None, label_info: LabelInfo | None = None) -> XMCModel:
    """Instantiate the configured components around `clusters`. encoder_params come from Encoder.export.

    A factory that declares the keyword-only parameter `label_info` receives `label_info` (the run's, or the
    saved model's); one that declares `encoder` (recallers, rankers, samplers) receives the encoder itself,
    whose parameters it then shares (xmcbench.interfaces.call_factory)."""
    encoder = _component(registry, "encoder", config.encoder, (config,), label_info, **(encoder_params or {}))
    levels = tree_levels(registry, config, clusters, encoder, label_info)
    in_dims = getattr(encoder, "level_dims", None) or (encoder.out_dim,) * (2 + len(levels))
    recaller = _component(registry, "recaller", config.recaller,
                          (config, in_dims[0], config.tree_levels[0] if levels else clusters.num_clusters),
                          label_info, encoder=encoder)
    registered_retriever = config.recaller in registry.retrievers
    if isinstance(recaller, Retriever) != registered_retriever:   # the run's early checks relied on the registration
        raise XmcError(f"recaller {config.recaller!r} is registered as a retriever but builds a "
                       f"{type(recaller).__name__}, not an xmcbench.interfaces.Retriever" if registered_retriever else
                       f"recaller {config.recaller!r} builds a Retriever, but its plugin registers it without "
                       "retriever=True (registry.add_component)")
    ranker = sampler = ranker_encoder = None
    # a retriever shortlists labels for a ranker, when the method names one, even with one label per cluster
    if not clusters.is_flat or (isinstance(recaller, Retriever) and config.ranker and config.sampler):
        ranker = _component(registry, "ranker", config.ranker, (config, in_dims[-1], clusters.num_labels), label_info,
                            encoder=encoder)
        sampler = _component(registry, "sampler", config.sampler, (config,), label_info, encoder=encoder)
        if config.separate_ranker_encoder:
            ranker_encoder = _component(registry, "encoder", config.encoder, (config,), label_info,
                                        **(encoder_params or {}))
    return XMCModel(encoder, recaller, ranker, sampler, clusters, ranker_encoder, levels,
                    score_combiner=config.score_combiner, ranker_weight=config.ranker_weight)


def _component(registry: Registry, kind: str, name: str, args: tuple, label_info: LabelInfo | None,
               encoder=None, **fixed):
    """A component built by its registered factory: factory(*args, **fixed, **what it declares of label_info
    and encoder)."""
    factory = registry.component(kind, name)
    wanted = declared_keywords(factory)
    if "label_info" in wanted and label_info is None:
        raise XmcError(f"{kind} {name!r} reads the labels' information (its factory takes label_info), which was "
                       "not given: the model folder predates label information, or the caller built the model "
                       "without a dataset; train the model again")
    offered = {"label_info": label_info, **({"encoder": encoder} if encoder is not None else {})}
    return call_factory(factory, *args, **fixed, **offered)


def tree_levels(registry: Registry, config: TrainConfig, clusters: LabelClusters, encoder,
                label_info: LabelInfo | None = None) -> tuple[TreeLevel, ...]:
    """The levels of config.tree_levels between the recaller's nodes and the leaf clusters: for each, a ranker
    of the configured kind over its nodes and a sampler built with top_clusters = the nodes kept above it."""
    if not config.tree_levels:
        return ()
    if clusters.is_flat or config.tree_levels[-1] >= clusters.num_clusters:
        raise RefusedSetting(f"tree_levels={','.join(map(str, config.tree_levels))} must have fewer nodes than the "
                             f"{clusters.num_clusters if not clusters.is_flat else 'flat'} leaf clusters below them; "
                             "set cluster_size (e.g. 8) or num_clusters above the last tree level")
    in_dims = getattr(encoder, "level_dims", None) or (encoder.out_dim,) * (2 + len(config.tree_levels))
    keeps = config.level_top or (config.top_clusters,) * len(config.tree_levels)
    levels = []
    for depth, (level_clusters, keep) in enumerate(zip(tree_level_clusters(clusters.num_clusters,
                                                                           config.tree_levels), keeps)):
        ranker = _component(registry, "ranker", config.ranker, (config, in_dims[1 + depth], level_clusters.num_labels),
                            label_info, encoder=encoder)
        sampler = _component(registry, "sampler", config.sampler, (dataclasses.replace(config, top_clusters=keep),),
                             label_info, encoder=encoder)
        levels.append(TreeLevel(ranker, sampler, level_clusters, keep))
    return tuple(levels)


# -- saving -----------------------------------------------------------------------------------------

def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a storage_dtype setting; any other value ends in one XmcError line."""
    if name not in STORAGE_DTYPES:
        raise RefusedSetting(f"storage_dtype={name!r} is not a storage dtype; valid ones: {', '.join(STORAGE_DTYPES)} "
                             f"(e.g. --set storage_dtype=float16)")
    return STORAGE_DTYPES[name]


def _unique_state(model: XMCModel) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's state_dict with each group of names sharing one tensor reduced to one name, as
    safetensors' save_model does (its load_model expects exactly that): (tensors, {dropped name: kept name})."""
    state = model.state_dict()
    dropped = {}
    for kept, names in _remove_duplicate_names(state).items():
        for name in names:
            dropped[name] = kept
            del state[name]
    return state, dropped


def model_size(model: XMCModel) -> dict:
    """{"parameters": the model's parameter count, "bytes": {storage dtype: bytes of tensor data its
    weights.safetensors holds when saved in that dtype}}. The file adds a header of a few KB (the tensors'
    names and shapes); integer buffers (label clusters) keep their own dtype in every storage dtype."""
    state, _ = _unique_state(model)
    sizes = {}
    for name, dtype in STORAGE_DTYPES.items():
        sizes[name] = sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
                          for t in state.values())
    return {"parameters": sum(p.numel() for p in model.parameters()), "bytes": sizes}


def stored_tensors(model: XMCModel, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors as weights.safetensors holds them, safetensors metadata): every floating-point tensor in
    `dtype`, integer ones unchanged, shared tensors once. A finite value beyond `dtype`'s range (float16
    tops out at 65504) would become infinite, so it ends in one XmcError line instead."""
    state, dropped = _unique_state(model)
    tensors = {}
    for name, tensor in state.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            converted = tensor.to(dtype)
            if int(torch.isfinite(converted).sum()) < int(torch.isfinite(tensor).sum()):
                largest = float(tensor[torch.isfinite(tensor)].abs().max())
                raise XmcError(f"tensor {name!r} holds values up to {largest:.4g}, beyond the range of "
                               f"{str(dtype).removeprefix('torch.')}: save with storage_dtype=bfloat16 or float32")
            tensor = converted
        tensors[name] = tensor.contiguous()
    return tensors, dropped

def file_digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return {"bytes": Path(path).stat().st_size, "sha256": digest.hexdigest()}


def save_model_dir(directory: Path, model: XMCModel, config: TrainConfig, label_names: list[str],
                   label_info: LabelInfo | None = None) -> None:
    """Write the model directory; floating-point weights are stored in config.storage_dtype. label_info (the
    run's) goes into label_info.json, so components that read it are rebuilt without the dataset."""
    directory = Path(directory)
    # converted before anything is written: a bad setting or an overflow leaves no half-written directory
    tensors, dropped = stored_tensors(model, storage_dtype(config.storage_dtype))
    if directory.exists():   # a model saved here before: a folder holds exactly what model.json lists
        (directory / "model.json").unlink(missing_ok=True)   # first, so a folder cut short never reads as a model
        shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    encoder_dir = directory / ENCODER_FOLDER
    encoder_params = model.encoder.export(encoder_dir)
    encoder_params = {k: (ENCODER_FOLDER if v == str(encoder_dir) else v) for k, v in encoder_params.items()}
    atomic_write(directory / "weights.safetensors",
                 lambda temporary: save_file(tensors, str(temporary), metadata=dropped or None))
    write_json(directory / "labels.json", label_names)
    files = ["weights.safetensors", "labels.json"]
    if label_info is not None:
        files.append(save_label_info(directory, label_info).name)
    for name, component in _components_with_files(model).items():
        folder = directory / COMPONENTS_FOLDER / name
        folder.mkdir(parents=True)
        component.save_files(folder)
    for folder in (encoder_dir, directory / COMPONENTS_FOLDER):
        if folder.is_dir():
            files += sorted(p.relative_to(directory).as_posix() for p in folder.rglob("*") if p.is_file())
    # model.json comes last: a directory whose save was interrupted has none (or an older one whose
    # checksums no longer match), so it is never taken for a complete model
    write_json(directory / "model.json", signed_description({
        "schema": SCHEMA_VERSION,
        "xmcbench_version": xmcbench.__version__,
        "config": config.to_dict(),
        "num_labels": model.clusters.num_labels,
        "num_clusters": model.clusters.num_clusters,
        "cluster_size": model.cluster_labels.shape[1],
        "encoder_params": encoder_params,
        "storage_dtype": config.storage_dtype,
        "files": {name: file_digest(directory / name) for name in files},
    }))


def _components_with_files(model: XMCModel) -> dict:
    """{name: component} of the model's components that write files of their own (LifecycleEvents.save_files)."""
    return {name: component for name, component, _ in model.components() if overrides(component, "save_files")}


def description_digest(meta: dict) -> str:
    """sha256 of model.json's contents without its own checksum (keys sorted, so formatting is free)."""
    content = {key: value for key, value in meta.items() if key != SELF_CHECKSUM}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def signed_description(meta: dict) -> dict:
    """model.json's contents with the checksum of themselves added, so an edit or damage is caught."""
    return {**meta, SELF_CHECKSUM: description_digest(meta)}


# -- loading ----------------------------------------------------------------------------------------

def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_count(value) -> bool:
    return _is_size(value) and value >= 1


def read_signed_description(path: Path, schema_version: int, required_keys: tuple[str, ...]) -> dict:
    """A model.json that is a JSON object, of a schema this xmcbench reads, matching its own checksum and
    holding `required_keys` (component models here; whole methods in xmcbench.whole_methods); anything
    else ends in one XmcError line."""
    meta = read_json(path, "the model description", REDO)
    if not isinstance(meta, dict):
        raise DamagedModel(f"{path} does not hold a JSON object: the model description is damaged; {REDO}")
    schema = meta.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise DamagedModel(f"{path} has no valid \"schema\" number: the model description is damaged; {REDO}")
    if schema > schema_version:
        written_by = meta.get("xmcbench_version")
        by = f" {written_by}" if isinstance(written_by, str) else ""
        raise DamagedModel(f"{path} has model schema {schema} but this xmcbench ({xmcbench.__version__}) reads "
                           f"schema {schema_version} at most: the model was written by a newer xmcbench{by}; "
                           "upgrade xmcbench (pip install -U xmcbench)")
    recorded = meta.get(SELF_CHECKSUM)
    if recorded is None:
        raise DamagedModel(f"{path} has no checksum of its own ({SELF_CHECKSUM!r}): it was written by an older "
                           f"xmcbench, or edited; {REDO}")
    if recorded != description_digest(meta):
        raise DamagedModel(f"{path} does not match its own checksum ({SELF_CHECKSUM!r}): it was edited or damaged "
                           f"after saving; {REDO}")
    missing = [key for key in required_keys if key not in meta]
    if missing:
        raise DamagedModel(f"{path} lacks {', '.join(repr(k) for k in missing)}: the model description is "
                           f"incomplete; {REDO}")
    return meta


def _read_meta(directory: Path) -> dict:
    path = directory / "model.json"
    meta = read_signed_description(path, SCHEMA_VERSION, REQUIRED_KEYS)
    for key in ("num_labels", "num_clusters", "cluster_size"):
        if not _is_count(meta[key]):
            raise DamagedModel(f"{path}: {key!r} must be a positive integer, got {meta[key]!r}; {REDO}")
    for key in ("config", "encoder_params"):
        if not isinstance(meta[key], dict):
            raise DamagedModel(f"{path}: {key!r} must be a JSON object, got {type(meta[key]).__name__}; {REDO}")
    if meta["num_clusters"] * meta["cluster_size"] < meta["num_labels"]:
        raise DamagedModel(f"{path}: {meta['num_clusters']} clusters of at most {meta['cluster_size']} labels cannot "
                           f"hold {meta['num_labels']} labels: the model description is damaged; {REDO}")
    stored = meta.setdefault("storage_dtype", DEFAULT_STORAGE_DTYPE)
    if stored not in STORAGE_DTYPES:
        raise DamagedModel(f"{path}: 'storage_dtype' is {stored!r}, which this xmcbench ({xmcbench.__version__}) "
                           f"cannot read (it reads {', '.join(STORAGE_DTYPES)}): the model description is damaged or "
                           f"comes from a newer xmcbench; upgrade xmcbench or {REDO}")
    return meta


def read_labels(directory: Path, num_labels: int) -> list[str]:
    path = directory / "labels.json"
    labels = read_json(path, "the label list", REDO)
    if not isinstance(labels, list) or not all(isinstance(name, str) for name in labels):
        raise DamagedModel(f"{path} must hold a JSON list of label names (strings): the label list is damaged; {REDO}")
    if len(labels) != num_labels:
        raise DamagedModel(f"{path} holds {len(labels)} labels but model.json says the model has {num_labels} "
                           f"(num_labels): the label list does not match the model; {REDO}")
    if len(set(labels)) != len(labels):
        seen, duplicate = set(), None
        for name in labels:
            if name in seen:
                duplicate = name
                break
            seen.add(name)
        raise DamagedModel(f"{path} names label {duplicate!r} twice: the label list is damaged; {REDO}")
    return labels


def _safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Check that `path` is a complete safetensors file without loading it: {name: (dtype, shape)}."""
    if not path.is_file():
        raise DamagedModel(f"{path} is missing: the model directory is incomplete; {REDO}")
    size = path.stat().st_size
    damaged = f"{path} is not a safetensors file (its header is unreadable): the weights are damaged; {REDO}"
    try:
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise DamagedModel(f"{path} is truncated ({size} bytes, not even a header): the weights are "
                                   f"incomplete; {REDO}")
            header_bytes = int.from_bytes(prefix, "little")
            if header_bytes < 2 or header_bytes > MAX_HEADER_BYTES:
                raise DamagedModel(damaged)
            if 8 + header_bytes > size:
                raise DamagedModel(f"{path} is truncated or is not a safetensors file ({size} bytes, its header "
                                   f"claims {8 + header_bytes}): the weights are damaged; {REDO}")
            raw = file.read(header_bytes)
    except OSError as error:
        raise DamagedModel(f"cannot read {path}: {error.strerror or error}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DamagedModel(damaged) from None
    if not isinstance(header, dict):
        raise DamagedModel(damaged)
    tensors, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            valid = (isinstance(dtype, str) and all(_is_size(d) for d in shape)
                     and _is_size(begin) and _is_size(stop) and begin <= stop)
        except (KeyError, TypeError, ValueError):
            valid = False
        if not valid:
            raise DamagedModel(f"{path} describes tensor {name!r} inconsistently: the weights are damaged; {REDO}")
        if dtype in DTYPE_BYTES and stop - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise DamagedModel(f"{path} describes tensor {name!r} ({dtype} {shape}) with {stop - begin} bytes of data: "
                               f"the weights are damaged; {REDO}")
        tensors[name] = (dtype, shape)
        end = max(end, stop)
    expected = 8 + header_bytes + end
    if size < expected:
        raise DamagedModel(f"{path} is truncated ({size} of {expected} bytes): the weights are incomplete; {REDO}")
    if size > expected:
        raise DamagedModel(f"{path} has {size - expected} unexpected bytes after its tensors: the weights are "
                           f"damaged; {REDO}")
    return tensors


def verify_files(directory: Path, meta: dict) -> None:
    """The folder holds exactly the files model.json recorded at save time (besides model.json), with their
    sizes and sha256: a file added later (a tokenizer's added_tokens.json, say) would change what the model
    does without changing any listed file, so it is refused too."""
    files = meta["files"]
    path = directory / "model.json"
    malformed = XmcError(f"{path}: its \"files\" checksums are malformed: the model description is damaged; {REDO}")
    if not isinstance(files, dict):
        raise malformed
    for name, record in files.items():
        relative = PurePosixPath(name)
        if (not isinstance(record, dict) or relative.is_absolute() or ".." in relative.parts
                or not _is_size(record.get("bytes"))
                or not re.fullmatch(r"[0-9a-f]{64}", str(record.get("sha256", "")))):
            raise malformed
    listed = {PurePosixPath(name).as_posix() for name in files} | {"model.json"}
    unlisted = sorted(found.relative_to(directory).as_posix() for found in directory.rglob("*")
                      if (found.is_symlink() or not found.is_dir())
                      and found.relative_to(directory).as_posix() not in listed)
    if unlisted:
        raise DamagedModel(f"{directory / unlisted[0]} is not one of the files model.json lists"
                           + (f" ({len(unlisted)} such files)" if len(unlisted) > 1 else "")
                           + f": a model folder holds exactly the files saved with it, and a file added later could "
                           f"change its predictions; remove it, or {REDO}")
    for name, record in files.items():          # sizes first: cheap, and the clearest message
        file = directory / name
        if not file.is_file():
            raise DamagedModel(f"{file} is missing: the model directory is incomplete; {REDO}")
        size = file.stat().st_size
        if size != record["bytes"]:
            state = "truncated" if size < record["bytes"] else "longer than when it was saved"
            raise DamagedModel(f"{file} is {state} ({size} bytes, model.json recorded {record['bytes']}): the file is "
                               f"damaged or comes from another model; {REDO}")
    for name, record in files.items():
        file = directory / name
        try:
            found = file_digest(file)["sha256"]
        except OSError as error:
            raise DamagedModel(f"cannot read {file}: {error.strerror or error}") from None
        if found != record["sha256"]:
            raise DamagedModel(f"{file} does not match the checksum (sha256) recorded in model.json: it was modified "
                               f"or damaged after saving, or comes from another model; {REDO}")


def _check_encoder_params(path: Path, encoder_params: dict) -> None:
    """A model folder reaches nothing outside itself: the encoder's model_name is its own encoder/ folder,
    and no other exported string is a path."""
    for key, value in encoder_params.items():
        if not isinstance(value, str) or value == ENCODER_FOLDER:
            continue
        if key == "model_name" or "/" in value or "\\" in value or value.startswith("."):
            raise DamagedModel(f"{path}: encoder_params.{key} is {value!r}, but a model folder may only refer to its "
                               f"own {ENCODER_FOLDER}/ folder; {REDO}")


def _check_components(registry: Registry, config: TrainConfig, flat: bool, path: Path) -> None:
    kinds = ("encoder", "recaller") if flat else ("encoder", "recaller", "ranker", "sampler")
    for kind in kinds:
        name = getattr(config, kind)
        if name not in registry.components[kind]:
            known = ", ".join(sorted(registry.components[kind])) or "none"
            failed = registry.failed and "; plugins that failed to load: " + ", ".join(f[0] for f in registry.failed)
            raise UnknownName(f"{path}: the model uses {kind} {name!r}, which no installed plugin provides "
                              f"(installed {kind}s: {known}{failed or ''}); install the plugin that registers "
                              f"{kind} {name!r} (`xmcbench plugins` lists the loaded ones)")


def _check_weights(path: Path, tensors: dict, model: XMCModel, stored: str) -> None:
    """Names, shapes and dtypes in the file against the model model.json describes (its floating-point
    tensors stored in `stored`, a storage dtype), before loading anything."""
    expected = model.state_dict()
    floating = SAFETENSORS_DTYPES[STORAGE_DTYPES[stored]]
    for name, (dtype, shape) in tensors.items():
        if name not in expected:
            continue
        if list(expected[name].shape) != shape:
            raise DamagedModel(f"{path} does not match model.json: tensor {name!r} has shape {shape} but model.json "
                               f"describes a model that needs {list(expected[name].shape)}; {REDO}")
        wanted = floating if expected[name].is_floating_point() else SAFETENSORS_DTYPES.get(expected[name].dtype)
        if wanted is not None and dtype != wanted:
            raise DamagedModel(f"{path} does not match model.json: tensor {name!r} is stored as {dtype} but model.json "
                               f"(storage_dtype {stored}) describes it as {wanted}; {REDO}")


def _describe_names(label: str, names) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{label} {shown}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def load_model_dir(directory: Path, registry: Registry) -> tuple[XMCModel, TrainConfig, list[str]]:
    """Load a model directory (or the model/ folder of a run directory). Every problem with its files ends
    in one XmcError line that names the file, says what is wrong and what to do."""
    try:
        return _load_model_dir(Path(directory), registry)
    except XmcError as error:
        message = str(error)
        if "\n" in message or "\r" in message:
            raise DamagedModel(joined_line(message)) from None
        raise


def _load_model_dir(directory: Path, registry: Registry) -> tuple[XMCModel, TrainConfig, list[str]]:
    if not directory.exists():
        raise DamagedModel(f"{directory} does not exist (give a run directory written by `xmcbench run`)")
    if (directory / "model").is_dir():   # a run directory was given
        directory = directory / "model"
    meta_path = directory / "model.json"
    if not meta_path.exists():
        raise DamagedModel(f"{directory} is not an xmcbench model: model.json is missing "
                           "(give a run directory written by `xmcbench run`)")
    meta = _read_meta(directory)
    num_labels, num_clusters, width = meta["num_labels"], meta["num_clusters"], meta["cluster_size"]
    label_names = read_labels(directory, num_labels)
    weights = directory / "weights.safetensors"
    tensors = _safetensors_header(weights)
    encoder_params = dict(meta["encoder_params"])
    _check_encoder_params(meta_path, encoder_params)
    if ENCODER_FOLDER in encoder_params.values() and not (directory / ENCODER_FOLDER).is_dir():
        raise DamagedModel(f"{directory / ENCODER_FOLDER} is missing: the encoder's config and tokenizer are not in "
                           f"the model directory; {REDO}")
    verify_files(directory, meta)

    try:
        config = TrainConfig.from_dict(meta["config"])
    except XmcError as error:
        version = meta.get("xmcbench_version")
        raise DamagedModel(f"{meta_path}: {joined_line(error)}: the model was written by another xmcbench "
                           f"({version}) or its description is damaged; upgrade xmcbench or {REDO}") from None
    flat = width == 1 and num_clusters == num_labels
    _check_components(registry, config, flat, meta_path)

    # placeholder clusters of the saved shapes; the real ones are buffers in the weights
    clusters = LabelClusters(torch.zeros(num_labels, dtype=torch.long),
                             torch.zeros(num_clusters, width, dtype=torch.long))
    if flat:
        clusters = LabelClusters.from_assignment(torch.arange(num_labels), num_labels)
    encoder_params = {k: (str(directory / v) if v == ENCODER_FOLDER else v) for k, v in encoder_params.items()}
    # the encoder reads its config and tokenizer from this folder and nowhere else (no other local
    # folder, no Hub download), and the machine it runs on is this one, not the one that trained it
    config = dataclasses.replace(config, model_name=str(directory / ENCODER_FOLDER), device="auto", threads=0)
    # every weight comes from weights.safetensors: never let the encoder read a checkpoint of its own
    if "pretrained_weights" in encoder_params:
        encoder_params["pretrained_weights"] = False
    label_info = load_label_info(directory, label_names, REDO)
    try:
        model = build_model(registry, dataclasses.replace(config, pretrained_weights=False), clusters,
                            encoder_params, label_info)
    except XmcError as error:
        raise DamagedModel(f"cannot rebuild the model of {directory}: {joined_line(error)}; {REDO}") from None
    _check_weights(weights, tensors, model, meta["storage_dtype"])
    try:   # load_state_dict copies each stored tensor into the model's float32 one: half ones are upcast
        missing, unexpected = load_model(model, str(weights), strict=False, device="cpu")
    except Exception as error:  # safetensors raises several types for damaged files
        raise DamagedModel(f"{weights} cannot be read: {joined_line(error)}; {REDO}") from None
    if missing or unexpected:
        parts = ([_describe_names("it lacks", missing)] if missing else []) + \
                ([_describe_names("it has unexpected tensors", unexpected)] if unexpected else [])
        raise DamagedModel(f"{weights} does not match model.json: {'; '.join(parts)}; {REDO}")
    label_cluster, cluster_labels = model.label_cluster, model.cluster_labels
    if (len(label_cluster) and (label_cluster.min() < 0 or label_cluster.max() >= num_clusters)) \
            or cluster_labels.min() < -1 or cluster_labels.max() >= num_labels \
            or int((cluster_labels >= 0).sum()) != num_labels:
        raise DamagedModel(f"{weights} holds label clusters that do not match model.json ({num_labels} labels in "
                           f"{num_clusters} clusters): the weights are damaged; {REDO}")
    for name, component in _components_with_files(model).items():
        # its listed files were verified above; a component that wrote none may find its (empty) folder gone,
        # as copies of a model (git, archives) drop empty folders
        folder = directory / COMPONENTS_FOLDER / name
        try:
            component.load_files(folder)
        except XmcError as error:
            raise DamagedModel(f"cannot read the files of the model's {name} in {folder}: {joined_line(error)}; "
                               f"{REDO}") from None
    model.eval()
    return model, config, label_names
