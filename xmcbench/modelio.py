"""Model directories: weights as safetensors, everything else as JSON, the encoder's config and tokenizer
as Hugging Face files. Loading never unpickles anything."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

import xmcbench
from xmcbench.config import TrainConfig
from xmcbench.errors import XmcError
from xmcbench.interfaces import LabelClusters
from xmcbench.pipeline import XMCModel
from xmcbench.registry import Registry
from xmcbench.storage import atomic_write, read_json, write_json

SCHEMA_VERSION = 1


def build_model(registry: Registry, config: TrainConfig, clusters: LabelClusters,
                encoder_params: dict | None = None) -> XMCModel:
    """Instantiate the configured components around `clusters`. encoder_params come from Encoder.export."""
    encoder = registry.component("encoder", config.encoder)(config, **(encoder_params or {}))
    recaller = registry.component("recaller", config.recaller)(config, encoder.out_dim, clusters.num_clusters)
    ranker = sampler = None
    if not clusters.is_flat:
        ranker = registry.component("ranker", config.ranker)(config, encoder.out_dim, clusters.num_labels)
        sampler = registry.component("sampler", config.sampler)(config)
    return XMCModel(encoder, recaller, ranker, sampler, clusters)


def save_model_dir(directory: Path, model: XMCModel, config: TrainConfig, label_names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    encoder_params = model.encoder.export(directory / "encoder")
    encoder_params = {k: ("encoder" if v == str(directory / "encoder") else v) for k, v in encoder_params.items()}
    atomic_write(directory / "weights.safetensors", lambda temporary: save_model(model, str(temporary)))
    write_json(directory / "labels.json", label_names)
    write_json(directory / "model.json", {
        "schema": SCHEMA_VERSION,
        "xmcbench_version": xmcbench.__version__,
        "config": config.to_dict(),
        "num_labels": model.clusters.num_labels,
        "num_clusters": model.clusters.num_clusters,
        "cluster_size": model.cluster_labels.shape[1],
        "encoder_params": encoder_params,
    })


def load_model_dir(directory: Path, registry: Registry) -> tuple[XMCModel, TrainConfig, list[str]]:
    directory = Path(directory)
    if (directory / "model").is_dir():   # a run directory was given
        directory = directory / "model"
    meta_path = directory / "model.json"
    if not meta_path.exists():
        raise XmcError(f"{directory} is not an xmcbench model: model.json is missing "
                       "(give a run directory written by `xmcbench run`)")
    try:
        meta = read_json(meta_path)
        label_names = read_json(directory / "labels.json")
    except (OSError, ValueError) as error:
        raise XmcError(f"cannot read model files in {directory}: {error}") from None
    if meta.get("schema", 0) > SCHEMA_VERSION:
        raise XmcError(f"{directory} was written by a newer xmcbench (model schema {meta['schema']}); upgrade xmcbench")
    config = TrainConfig.from_dict(meta["config"])
    if len(label_names) != meta["num_labels"]:
        raise XmcError(f"{directory}: labels.json holds {len(label_names)} labels but the model has "
                       f"{meta['num_labels']}; the model directory is inconsistent")
    num_labels, num_clusters, width = meta["num_labels"], meta["num_clusters"], meta["cluster_size"]
    # placeholder clusters of the saved shapes; the real ones are buffers in the weights
    clusters = LabelClusters(torch.zeros(num_labels, dtype=torch.long),
                             torch.zeros(num_clusters, width, dtype=torch.long))
    if width == 1 and num_clusters == num_labels:
        clusters = LabelClusters.from_assignment(torch.arange(num_labels), num_labels)
    encoder_params = {k: (str(directory / v) if v == "encoder" else v) for k, v in meta["encoder_params"].items()}
    model = build_model(registry, config, clusters, encoder_params)
    weights = directory / "weights.safetensors"
    if not weights.exists():
        raise XmcError(f"{directory}: weights.safetensors is missing")
    try:
        load_model(model, str(weights), strict=True, device="cpu")
    except Exception as error:  # safetensors raises several types for truncated or mismatched files
        raise XmcError(f"{weights} does not match the model it describes: {str(error).splitlines()[0]}") from None
    model.eval()
    return model, config, label_names
