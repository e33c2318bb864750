"""The four component contracts, and the whole-method contract. Shapes: B documents, T tokens, D
representation size, K clusters, L labels, P positives per document (padded), C candidate labels per
document (padded), N texts, k labels kept per text.

Components are `torch.nn.Module`s. They never move themselves to a device or choose a precision: the
pipeline does (`model.to(device)`, autocast), so every buffer a component needs must be registered.

What a factory may receive besides its positional arguments (see `call_factory`): a keyword-only parameter
`label_info` gets the run's LabelInfo (names, texts, training counts, propensities), and a keyword-only
parameter `encoder` (recallers, rankers, samplers) gets the method's encoder itself, so a component can embed
label texts with the same weights (a dual encoder's towers): shared parameters are trained, saved and counted
once. Recallers, rankers and samplers receive the training loop's lifecycle events (`LifecycleEvents`).

A whole method (`WholeMethod`) is not built from components: a classic linear XMC method fits, saves,
loads and predicts on its own, and the run (xmcbench.runs.whole) only hands it texts and labels. Its contract
lives in xmcbench/whole_contract.py, which imports no torch (a plugin of whole methods loads without it), and is
imported here too: `xmcbench.interfaces.WholeMethod` is the same class.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch import nn

from xmcbench.whole_contract import WholeMethod

if TYPE_CHECKING:
    import scipy.sparse as sp
    from xmcbench.config import Stage

__all__ = ["Candidates", "Encoder", "EpochContext", "LabelClusters", "LabelInfo", "LifecycleEvents",
           "OFFERED_KEYWORDS", "Ranker", "Recaller", "Retriever", "Sampler", "StageContext", "WholeMethod",
           "call_factory", "declared_keywords", "overrides", "tree_level_clusters"]


@dataclass
class LabelClusters:
    """The label -> cluster assignment as tensors the components share.

    label_cluster:  (L,) long, the cluster of each label.
    cluster_labels: (K, S) long, the labels of each cluster padded with -1 (S = largest cluster).
    """

    label_cluster: torch.Tensor
    cluster_labels: torch.Tensor

    @classmethod
    def from_assignment(cls, label_cluster: torch.Tensor, num_clusters: int) -> "LabelClusters":
        label_cluster = label_cluster.long()
        sizes = torch.bincount(label_cluster, minlength=num_clusters)
        order = torch.argsort(label_cluster, stable=True)
        slot = torch.arange(len(order)) - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
        cluster_labels = torch.full((num_clusters, int(sizes.max())), -1, dtype=torch.long)
        cluster_labels[label_cluster[order], slot] = order
        return cls(label_cluster, cluster_labels)

    @property
    def num_clusters(self) -> int:
        return self.cluster_labels.shape[0]

    @property
    def num_labels(self) -> int:
        return self.label_cluster.shape[0]

    @property
    def is_flat(self) -> bool:
        """One label per cluster: the recaller scores every label and no ranker is needed."""
        return self.cluster_labels.shape[1] == 1 and self.num_clusters == self.num_labels

    def to(self, device) -> "LabelClusters":
        return LabelClusters(self.label_cluster.to(device), self.cluster_labels.to(device))


def tree_level_clusters(num_clusters: int, tree_levels: tuple[int, ...]) -> list[LabelClusters]:
    """The levels of a deeper label tree (TrainConfig.tree_levels, coarse to fine) above `num_clusters` leaf
    clusters: for each level after the first, a LabelClusters whose items are that level's nodes and whose
    clusters are the nodes of the level above; the last one's items are the leaf clusters. Leaf cluster ids
    follow a binary tree, as every label indexer numbers them (xmcbench.indexing), so leaf c's ancestor among n
    nodes is c // (num_clusters // n), and every level splits each node of the level above into the same number
    of children."""
    sizes = [*tree_levels, num_clusters]
    return [LabelClusters.from_assignment(torch.arange(finer) // (finer // coarser), coarser)
            for coarser, finer in zip(sizes, sizes[1:])]


@dataclass(frozen=True)
class LabelInfo:
    """What a method may know of its labels, in label-id order (the model's vocabulary of L labels).

    names:   (L,) the label names (as `predict` reports them).
    texts:   (L,) one text per label (a label the dataset gives no text keeps its name), or None when the
             dataset carries no label texts at all.
    counts:  (L,) int64, the training documents of each label among the run's training rows (0: a label no
             training document carries).
    inverse_propensities: (L,) float64, 1 / p_l of the run's propensity model (Jain et al. 2016, counted on
             every training document of the dataset), the weights of PSP@k.

    A component factory or a whole method receives it when it declares a keyword-only parameter
    `label_info` (see CONTRIBUTING.md); a saved model keeps it (model/label_info.json), so prediction needs no
    dataset."""

    names: tuple[str, ...]
    texts: tuple[str, ...] | None
    counts: np.ndarray
    inverse_propensities: np.ndarray

    def __post_init__(self) -> None:
        size = len(self.names)
        if self.texts is not None and len(self.texts) != size:
            raise ValueError(f"LabelInfo has {size} names but {len(self.texts)} texts")
        if np.shape(self.counts) != (size,) or np.shape(self.inverse_propensities) != (size,):
            raise ValueError(f"LabelInfo has {size} names but counts of shape {np.shape(self.counts)} and "
                             f"inverse_propensities of shape {np.shape(self.inverse_propensities)}")

    @property
    def num_labels(self) -> int:
        return len(self.names)

    @property
    def has_texts(self) -> bool:
        return self.texts is not None


# The keyword-only parameters a factory (or a whole method's fit and load, or a MethodSpec's derive) may declare
# to receive them.
OFFERED_KEYWORDS = ("label_info", "encoder", "checkpoint_dir", "settings")


def declared_keywords(function: Callable) -> set[str]:
    """The keyword-only parameters of `function` (a factory, a class, a method) among OFFERED_KEYWORDS."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):   # a builtin without a signature declares nothing
        return set()
    return {p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.name in OFFERED_KEYWORDS}


def call_factory(function: Callable, *args: Any, **keywords: Any) -> Any:
    """function(*args, **keywords), where a keyword of OFFERED_KEYWORDS goes only to a function that declares it
    as a keyword-only parameter (others, e.g. an encoder's exported parameters, always go): factories written
    before a keyword was offered keep working unchanged, and an offered keyword never lands in a **kwargs."""
    wanted = declared_keywords(function)
    return function(*args, **{name: value for name, value in keywords.items()
                               if name not in OFFERED_KEYWORDS or name in wanted})


@dataclass
class Candidates:
    """What the ranker scores for each document.

    labels:   (B, C) long label ids; padded slots hold 0 and are masked out.
    mask:     (B, C) bool, True for real candidates. No label appears twice in a row.
    clusters: (B, C) long, the cluster each candidate came from (for the recall score).
    targets:  (B, C) float 0/1 during training (1 = positive label), None at prediction time.
    """

    labels: torch.Tensor
    mask: torch.Tensor
    clusters: torch.Tensor
    targets: torch.Tensor | None = None


@dataclass
class StageContext:
    """What a sampler may use when a training stage begins.

    num_documents: N, the training documents (doc_index values are 0..N-1).
    recalled_clusters(top) -> (N, top) long: each training document's top clusters under the current model
        (computed in eval mode, without gradients): the clusters this sampler's candidates come from, which
        are the recaller's, or, in a deeper tree, the nodes the level above this sampler's keeps.
    """

    stage: "Stage"           # xmcbench.config.Stage: its name, the parts it trains, the losses it counts
    num_documents: int
    recalled_clusters: Callable[[int], torch.Tensor]


@dataclass
class EpochContext:
    """What a component may use when an epoch begins (`start_epoch`) or before a prediction (`finalize`).

    Everything here is computed on demand, by the core's one sharded inference loop
    (`xmcbench.inference.map_documents`: eval mode, no gradients, batches of similar length, shared among the
    processes of a distributed run), so a component that asks for nothing costs nothing.

    stage: the stage under way (at the end of training: the last one); epoch: the 0-based epoch of that stage
        about to begin (at finalize: None).
    final: at finalize, whether training has ended (the weights that will be saved), not a validation's model:
        a component may then build what only the saved model needs (e.g. an approximate index, slow to build).
    num_documents: N, the training documents (doc_index values are 0..N-1).
    label_info: the run's LabelInfo (names, texts, training counts, inverse propensities).
    document_embeddings() -> (N, D) float32: the encoder's representation of every training document.
    label_embeddings() -> (L, D) float32: the encoder's representation of every label's text (LabelInfo.texts,
        tokenized as the documents are; the label names when the dataset has no label texts).
    map_documents(function, dim) / map_labels(function, dim) -> (N, dim) / (L, dim) float32: any
        function(input_ids (B, T), attention_mask (B, T)) -> (B, dim) over the training documents or the label
        texts (e.g. a tower of the component's own).
    recalled_clusters(top) -> (N, top) long: as StageContext's.
    ranker: the label-level ranker of the model the event is about (the SWA average at a validation where
        averaging runs), e.g. for a retriever to search the label vectors that ranker scores with; None in
        xmcbench.testing's synthetic contexts.
    training_labels: (N, L) 0/1 csr, the labels of the training documents (rows as document_embeddings', columns
        the model's L labels in label-id order: labels only the test set has are not among them), e.g. to start
        each label's weights at the mean of its documents; None where the caller has none.
    validation_labels: (V, L) 0/1 csr, the labels of the run's validation documents (columns as
        training_labels'), e.g. to calibrate scores on documents training never saw; None without a validation
        split. validation_embeddings() -> (V, D) float32: the encoder's representation of those documents.
    """

    stage: "Stage"
    epoch: int | None
    num_documents: int
    label_info: LabelInfo | None
    map_documents: Callable[[Callable, int], torch.Tensor]
    map_labels: Callable[[Callable, int], torch.Tensor]
    recalled_clusters: Callable[[int], torch.Tensor]
    encoder: "Encoder"
    cache: dict = field(default_factory=dict, repr=False)   # shared by the copies one event hands out
    final: bool = False
    ranker: "Ranker | None" = None
    training_labels: "sp.csr_matrix | None" = None
    validation_labels: "sp.csr_matrix | None" = None
    map_validation: Callable[[Callable, int], torch.Tensor] | None = None

    def document_embeddings(self) -> torch.Tensor:
        """(N, D) float32, computed once per event."""
        if "documents" not in self.cache:
            self.cache["documents"] = self.map_documents(self.encoder, self.encoder.out_dim)
        return self.cache["documents"]

    def label_embeddings(self) -> torch.Tensor:
        """(L, D) float32, computed once per event."""
        if "labels" not in self.cache:
            self.cache["labels"] = self.map_labels(self.encoder, self.encoder.out_dim)
        return self.cache["labels"]

    def validation_embeddings(self) -> torch.Tensor:
        """(V, D) float32, computed once per event; only where validation_labels is not None."""
        if self.map_validation is None:
            raise ValueError("this event has no validation documents (EpochContext.validation_labels is None)")
        if "validation" not in self.cache:
            self.cache["validation"] = self.map_validation(self.encoder, self.encoder.out_dim)
        return self.cache["validation"]


class LifecycleEvents:
    """Events the training loop announces to the recaller, the rankers and the samplers; each does nothing
    unless a component overrides it (and one that does not is never asked to compute anything).

    start_stage(StageContext)  a training stage begins (not when a checkpoint resumes inside it).
    start_epoch(EpochContext)  an epoch begins (not when a checkpoint resumes inside it): e.g. mine hard
                               negatives from the current model's document and label embeddings.
    finalize(EpochContext)     prediction is about to read the current weights: before each validation (on
                               the model validated: the SWA average where averaging runs) and once training has
                               ended with the final weights in place, before the test set is predicted and the
                               model saved: e.g. build a label index. It must depend on the weights only, as
                               it may run several times.
    training_state() / load_training_state(state): what the component keeps between these events beyond its
        weights (e.g. negatives mined at an epoch's start), a dict of tensors that checkpoints carry, so a run
        resumed inside an epoch continues exactly. Not part of the saved model: state a prediction needs
        belongs in registered buffers (weights.safetensors) or in save_files.
    save_files(directory) / load_files(directory): files of the saved model beyond its tensors (e.g. an
        approximate-nearest-neighbour index in its library's own format, never a pickle), written into and
        read from the model folder's `components/<part>/` (which the model's checksums cover).
    """

    def start_stage(self, context: StageContext) -> None:
        """Called when a training stage begins (not when a checkpoint resumes inside one)."""

    def start_epoch(self, context: EpochContext) -> None:
        """Called when an epoch begins (not when a checkpoint resumes inside one)."""

    def finalize(self, context: EpochContext) -> None:
        """Called before each validation and once training has ended: build what prediction reads."""

    def training_state(self) -> dict[str, torch.Tensor]:
        return {}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what training_state returned."""

    def save_files(self, directory: Path) -> None:
        """Write the saved model's files of this component into `directory` (it exists and is empty)."""

    def load_files(self, directory: Path) -> None:
        """Read what save_files wrote (called after the weights are loaded, the files verified against model.json;
        a component that wrote nothing may find `directory` missing, as copies of a model drop empty folders)."""


def overrides(component: object, event: str) -> bool:
    """Whether `component` implements lifecycle event `event` itself (the core computes an event's context
    only for components that do)."""
    return getattr(type(component), event, None) is not getattr(LifecycleEvents, event)


class Encoder(nn.Module, ABC):
    """Token ids and attention mask (B, T) -> text representation (B, D).

    level_dims: None (every level of the label tree reads the whole representation), or one size per
    scoring level, coarse to fine (the recaller, each of TrainConfig.tree_levels, the labels), adding up to
    out_dim: level j then reads its own slice of the representation (e.g. the [CLS] states of its own layers,
    as CascadeXML). An encoder that declares it reads the number of levels from config.tree_levels."""

    out_dim: int
    level_dims: tuple[int, ...] | None = None
    #: the Hugging Face tokenizer that produces the ids this encoder reads
    tokenizer: object
    #: the dtype its pretrained weights were loaded in ("float16" for a half-precision checkpoint), before
    #: they became float32 master weights; None when it starts from random weights. Recorded in config.json.
    loaded_dtype: str | None = None

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) long ids, (B, T) 0/1 mask -> (B, out_dim)."""

    def tokens_to_read(self, max_length: int) -> int:
        """How many tokens of each document the pipeline gives this encoder: config.max_length, the transformer's
        window, unless the encoder reads more of a document than its transformer does (LightXML's bag of word
        pieces over a longer window); it then fits what its transformer reads into max_length itself."""
        return max_length

    @abstractmethod
    def export(self, directory: Path) -> dict:
        """Write what is needed to rebuild this encoder offline (config, tokenizer; not the weights, which
        the pipeline saves as safetensors) and return the factory parameters that rebuild it from there."""


class Recaller(nn.Module, LifecycleEvents, ABC):
    """Representation (B, D) -> cluster logits (B, K)."""

    num_clusters: int

    @abstractmethod
    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        """(B, D) -> (B, num_clusters) logits."""

    def loss(self, logits: torch.Tensor, cluster_targets: torch.Tensor) -> torch.Tensor:
        """Binary cross-entropy of (B, K) logits against (B, K) multi-hot cluster targets, a scalar."""
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), cluster_targets)


class Retriever(Recaller):
    """A recaller over the labels themselves (one label per cluster, num_clusters = L) that finds a document's
    best labels by nearest-neighbour search over label embeddings: the alternative to a recaller scoring label
    clusters. Prediction asks `search` for the top labels, never for a (B, L) score matrix; with a ranker the
    model scores those labels again (the ranker's candidates), without one the search scores are the result.

    forward(representation) -> (B, L) logits is the exact score of every label: it is called in training when
    the stage counts the recall loss or the sampler reads recall logits, so a retriever over millions of labels
    trains with a sampler that does not (Sampler.reads_recall_logits = False). Build the index in `finalize`
    (and refresh it in `start_epoch` if training reads it); keep it in registered buffers or `save_files`."""

    def search(self, representation: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, D) -> (labels (B, top) long, logits (B, top) float), best first. Default: exact, over forward."""
        logits, labels = self(representation).float().topk(min(top, self.num_clusters), dim=1)
        return labels, logits


class Sampler(nn.Module, LifecycleEvents, ABC):
    """Training only: decides which candidate labels the ranker sees, and their 0/1 targets.

    Contract: every positive label of a document is among its candidates, exactly once (with samples_positives:
    at least one of them, none twice).
    In a deeper label tree (TrainConfig.tree_levels) each level has a sampler of its own, built with
    config.top_clusters set to the nodes that level keeps; its "labels" are that level's nodes, its
    "clusters" their parents, its recall_logits the level above's logits over all its nodes (the lowest
    float where the level above scored none), its positives the ancestors of the positive labels there.
    Samplers that keep per-document state (e.g. frozen candidates) fill it in `start_stage` or `start_epoch`
    and expose it through `training_state`/`load_training_state`, so checkpoints carry it; it is not part of
    the model.

    reads_recall_logits: False for a sampler that never looks at recall_logits (e.g. one that draws its
    negatives from a label index it mined at an epoch's start); with a Retriever as the recaller and a stage
    that does not count the recall loss, the model then passes recall_logits=None instead of scoring every
    label.
    """

    reads_recall_logits: bool = True
    #: True for a sampler that draws a subset of each document's positives at every step (DEXML samples one for
    #: its softmax): the contract then asks at least one positive of each document that has any, none twice, and
    #: targets 1 on every candidate that is a positive of the document, sampled or not
    samples_positives: bool = False

    @abstractmethod
    def forward(self, recall_logits: torch.Tensor | None, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        """recall_logits (B, K) detached; positives (B, P) label ids padded with -1; doc_index (B,) the
        documents' row numbers in the training set (for samplers that remember per-document state)."""


class Ranker(nn.Module, LifecycleEvents, ABC):
    """Representation (B, D) and candidate label ids (B, C) -> logits (B, C).

    loss: how the logits of a batch's candidates are trained (binary cross-entropy by default; a contrastive
    ranker overrides it, e.g. a softmax over each document's candidates)."""

    @abstractmethod
    def forward(self, representation: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
        """(B, D), (B, C) long -> (B, C) logits."""

    def loss(self, logits: torch.Tensor, candidates: Candidates) -> torch.Tensor:
        """(B, C) logits of `candidates` (their targets (B, C) 0/1, their mask (B, C) True for real ones) -> a
        scalar: the mean over real candidates of the binary cross-entropy."""
        per_candidate = nn.functional.binary_cross_entropy_with_logits(logits.float(), candidates.targets,
                                                                       reduction="none")
        real = candidates.mask.float()
        # the mean over real candidates as a weighted sum: a boolean-mask selection would make the host wait
        # for the device to learn its size
        return (per_candidate * real).sum() / real.sum().clamp_min(1.0)
