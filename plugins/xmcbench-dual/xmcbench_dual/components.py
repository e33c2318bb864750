"""The dual encoder's components: the label tower and loss (ranker `dual-tower`), the label index prediction
searches (retriever `label-index`) and the negatives (sampler `index-negatives`). Shapes: B documents, D the
encoder's size, L labels, C candidates per document, k labels kept per document.

Documents and labels are embedded by the method's one encoder (the `encoder` every factory here declares: one set
of weights, trained by both towers, saved once) and compared by cosine similarity. A label's embedding is its text's
(LabelInfo.texts; a label without a text, its name), plus, with options.free_vectors, a free vector of its own
(DEXA, Dahiya et al., KDD 2023), both normalised. With options.classifier, a second stage trains one more vector
per label on the frozen encoder (NGAME's classifier over the index's shortlist), whose score the method fuses with
the search's (score_combiner weighted-sum).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from xmcbench.candidates import positive_targets, unique_per_row
from xmcbench import label_index
from xmcbench.label_index import LAYOUT_FILE, LabelIndex
from xmcbench.interfaces import Candidates, EpochContext, LabelClusters, LabelInfo, Ranker, Retriever, Sampler, \
    StageContext
from xmcbench.tokenization import tokenize

from xmcbench_dual.losses import decoupled_softmax, triplet_margin
from xmcbench_dual.options import CLASSIFIER_STAGE, RANKER_OPTIONS, SAMPLER_OPTIONS

def normalized(vectors: torch.Tensor) -> torch.Tensor:
    return nn.functional.normalize(vectors, dim=-1)


# -- the label tower ------------------------------------------------------------------------------------------

class DualTower(Ranker):
    """(B, D) representation, (B, C) candidate ids -> (B, C) cosine similarities of the document and the candidates'
    label embeddings (with a classifier: of the document and the candidates' classifier vectors, once trained).

    Training encodes the candidates' texts with the shared encoder at every step (gradients reach it through both
    towers); prediction reads `text_vectors`, every label's text embedding computed by `finalize`."""

    def __init__(self, encoder, label_info: LabelInfo, label_length: int, loss: str, tau: float, margin: float,
                 triplet_negatives: int, free_vectors: bool, classifier: bool) -> None:
        super().__init__()
        self.encoder = encoder   # the method's encoder itself (shared), never a copy
        texts = list(label_info.texts or label_info.names)
        # rebuilt from the texts when loaded; a step pads its candidates' texts to the longest of them only
        self.text_tokens = tokenize(texts, encoder.tokenizer, label_length, None, description=None)
        self.register_buffer("text_vectors", torch.zeros(len(texts), encoder.out_dim))   # (L, D), saved
        self.loss_name, self.tau, self.margin, self.triplet_negatives = loss, tau, margin, triplet_negatives
        # DEXA's free vectors start at 0: a label starts at its text; sparse, so a step updates its candidates' rows
        self.free = nn.Embedding(len(texts), encoder.out_dim, sparse=True) if free_vectors else None
        if self.free is not None:
            nn.init.zeros_(self.free.weight)
        self.classifier = nn.Embedding(len(texts), encoder.out_dim, sparse=True) if classifier else None
        # 1 once the classifier stage has started: prediction then scores with the classifier (saved with the model)
        self.register_buffer("classifier_trained", torch.zeros((), dtype=torch.bool))
        self.training_classifier = False

    def label_vectors(self, labels: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """(..., D) normalised label embeddings of label ids (...) whose text embeddings are `text` (..., D)."""
        vectors = normalized(text)
        if self.free is not None:
            vectors = normalized(vectors + self.free(labels))
        return vectors

    def all_label_vectors(self, text: torch.Tensor) -> torch.Tensor:
        """(L, D) every label's embedding as the tower scores it, from every label's text embedding `text` (L, D)."""
        labels = torch.arange(len(text), device=self.text_vectors.device)
        return self.label_vectors(labels, text.to(self.text_vectors))

    def forward(self, representation: torch.Tensor, candidate_labels: torch.Tensor) -> torch.Tensor:
        document = normalized(representation)                                           # (B, D)
        if self.classifier is not None and (self.training_classifier or
                                            (not self.training and bool(self.classifier_trained))):
            return torch.einsum("bd,bcd->bc", document, normalized(self.classifier(candidate_labels)))
        if not self.training:
            return torch.einsum("bd,bcd->bc", document,
                                self.label_vectors(candidate_labels, self.text_vectors[candidate_labels]))
        unique, inverse = torch.unique(candidate_labels, return_inverse=True)          # (U,), (B, C)
        ids, mask = (part.to(document.device) for part in self.text_tokens.batch(unique.cpu().numpy()))
        text = self.encoder(ids, mask)                                                  # (U, D)
        return (document @ self.label_vectors(unique, text).T).gather(1, inverse)

    def loss(self, logits: torch.Tensor, candidates: Candidates) -> torch.Tensor:
        if self.loss_name == "triplet" or self.training_classifier:
            return triplet_margin(logits, candidates.targets, candidates.mask, self.margin, self.triplet_negatives)
        return decoupled_softmax(logits, candidates.targets, candidates.mask, self.tau)

    def start_stage(self, context: StageContext) -> None:
        self.training_classifier = self.classifier is not None and context.stage.name == CLASSIFIER_STAGE

    def start_epoch(self, context: EpochContext) -> None:
        if self.training_classifier and context.epoch == 0:   # NGAME: classifiers start at their label embeddings
            with torch.no_grad():
                self.classifier.weight.copy_(self.all_label_vectors(context.label_embeddings()))
                self.classifier_trained.fill_(True)

    def finalize(self, context: EpochContext) -> None:
        self.text_vectors.copy_(context.label_embeddings().to(self.text_vectors))

    def training_state(self) -> dict[str, torch.Tensor]:
        return {"training_classifier": torch.tensor(self.training_classifier)}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        self.training_classifier = bool(state.get("training_classifier", False))


def searched_label_vectors(context: EpochContext) -> torch.Tensor:
    """(L, D) normalised: the label vectors the model's dual tower scores with (with free vectors: text + free
    vector), which the index must search and the negatives must be mined from, or the text embeddings under
    another ranker. Computed once per event (EpochContext.cache)."""
    if "dual_label_vectors" not in context.cache:
        text = context.label_embeddings()
        with torch.no_grad():
            vectors = (context.ranker.all_label_vectors(text) if isinstance(context.ranker, DualTower)
                       else normalized(text))
        context.cache["dual_label_vectors"] = vectors.float().cpu()
    return context.cache["dual_label_vectors"]


def build_dual_tower(config, in_dim: int, num_labels: int, *, encoder, label_info: LabelInfo) -> DualTower:
    values = {option.name: option.value_of(config) for option in RANKER_OPTIONS}
    return DualTower(encoder, label_info, values.pop("label_length") or config.max_length, **values)


# -- the index prediction searches ------------------------------------------------------------------------------

class LabelIndexRetriever(Retriever):
    """Nearest-neighbour search over every label's vector as the dual tower scores it (searched_label_vectors: its
    normalised text embedding, plus its free vector with free_vectors), rebuilt by `finalize` (before each
    validation and when training ends) from the shared encoder: a document's top labels by cosine similarity, the
    shortlist the label tower then scores. The search is xmcbench.label_index's: exact below its EXACT_BELOW labels
    (as fast there, and it misses nothing) and for validations; from EXACT_BELOW labels on, the final model's is a
    seeded HNSW graph when faiss is installed, saved in the model folder (save_files). An exact index is rebuilt
    from the saved vectors when the model is loaded."""

    def __init__(self, num_labels: int, dim: int, seed: int, threads: int) -> None:
        super().__init__()
        self.num_clusters = num_labels
        self.seed, self.threads = seed, threads
        self.register_buffer("label_vectors", torch.zeros(num_labels, dim))   # (L, D) normalised, saved
        self.index: LabelIndex | None = None

    def forward(self, representation: torch.Tensor) -> torch.Tensor:
        return normalized(representation) @ self.label_vectors.T                     # (B, L)

    def search(self, representation: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index is None:   # not finalized since built or loaded: the vectors it holds, searched exactly
            self.index = LabelIndex(self.label_vectors, threads=self.threads)
        labels, scores = self.index.search(normalized(representation.float()), top)
        return labels, scores

    def finalize(self, context: EpochContext) -> None:
        self.label_vectors.copy_(searched_label_vectors(context).to(self.label_vectors))
        # a validation searches exactly: above EXACT_BELOW labels that costs less than building a graph each time
        # (452 s on one thread at 500,000 labels); the saved model's graph is built once, when training ends
        exact_below = label_index.EXACT_BELOW if context.final else len(self.label_vectors) + 1
        self.index = LabelIndex.build(self.label_vectors, seed=self.seed, threads=self.threads, exact_below=exact_below)

    def save_files(self, directory: Path) -> None:
        if self.index is not None and not self.index.exact:   # only a graph is more than the saved vectors
            self.index.save(directory)

    def load_files(self, directory: Path) -> None:
        graph_saved = (directory / LAYOUT_FILE).exists()
        self.index = LabelIndex.load(directory, threads=self.threads) if graph_saved else None


def build_label_index(config, in_dim: int, num_labels: int, *, encoder) -> LabelIndexRetriever:
    return LabelIndexRetriever(num_labels, encoder.out_dim, config.seed, config.threads)


# -- negatives ----------------------------------------------------------------------------------------------

class IndexNegatives(Sampler):
    """A document's candidates: positives_per_document of its positives drawn at random at each step (all with
    0), the positives the other documents of the batch drew (in-batch negatives, unless they are its positives
    too) and, from epoch mine_from_epoch of a stage on, hard negatives: each document draws negatives_per_document
    of its own top hard_negatives labels under the current model (mined every refresh_every epochs from the
    document and label embeddings), shared with the batch too (DEXML's hard-negative mining). Every candidate that
    is a positive of the document is one for the loss, drawn or not."""

    reads_recall_logits = False

    def __init__(self, positives_per_document: int, hard_negatives: int, negatives_per_document: int,
                 mine_from_epoch: int, refresh_every: int) -> None:
        super().__init__()
        self.positives_per_document = positives_per_document
        self.samples_positives = positives_per_document > 0
        self.hard_negatives, self.per_document = hard_negatives, negatives_per_document
        self.mine_from_epoch, self.refresh_every = mine_from_epoch, refresh_every
        self.mined: torch.Tensor | None = None   # (N, hard_negatives) long, on the CPU

    def start_stage(self, context: StageContext) -> None:
        self.mined = None   # a stage mines from its own model

    def start_epoch(self, context: EpochContext) -> None:
        since = context.epoch - self.mine_from_epoch
        if self.hard_negatives and self.per_document and since >= 0 and since % self.refresh_every == 0:
            documents = normalized(context.document_embeddings())
            labels = searched_label_vectors(context)
            top = min(self.hard_negatives, len(labels))
            self.mined = torch.cat([(rows @ labels.T).topk(top, dim=1).indices
                                    for rows in documents.split(4096)])              # bounded memory: 4,096 rows at once

    def training_state(self) -> dict[str, torch.Tensor]:
        return {} if self.mined is None else {"mined": self.mined}

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        self.mined = state.get("mined")

    def forward(self, recall_logits, positives: torch.Tensor, clusters: LabelClusters,
                doc_index: torch.Tensor) -> Candidates:
        batch = positives.shape[0]
        drawn = positives
        if self.positives_per_document and positives.shape[1] > self.positives_per_document:
            # random keys, padding (-1) sorted last: the first keys are a uniform draw without replacement
            keys = torch.rand(positives.shape, device=positives.device).masked_fill(positives < 0, 2.0)
            drawn = positives.gather(1, keys.argsort(dim=1)[:, :self.positives_per_document])   # (B, p)
        shared = [drawn.reshape(1, -1)]                                                 # the batch's drawn positives
        if self.mined is not None:
            mined = self.mined[doc_index.cpu()]                                          # (B, hard_negatives)
            draws = torch.randint(mined.shape[1], (batch, self.per_document))
            shared.append(mined.gather(1, draws).reshape(1, -1).to(positives.device))
        ids = torch.cat([drawn, *(part.expand(batch, -1) for part in shared)], dim=1)
        labels, keep = unique_per_row(ids.clamp_min(0), ids >= 0)
        return Candidates(labels=labels, mask=keep, clusters=clusters.label_cluster[labels],
                          targets=positive_targets(labels, positives) * keep)


def build_index_negatives(config) -> IndexNegatives:
    return IndexNegatives(*(option.value_of(config) for option in SAMPLER_OPTIONS))
