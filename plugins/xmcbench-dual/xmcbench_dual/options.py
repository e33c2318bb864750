"""The options of the dual-encoder components and the name of the classifier stage, in a module of their own: the
plugin and its methods read them without importing the components (torch), see plugin.py."""

from xmcbench.config import Option

CLASSIFIER_STAGE = "classifier"   # the stage in which the ranker trains its classifier vectors

RANKER_OPTIONS = (
    Option("loss", str, "decoupled-softmax", "the contrastive loss: DEXML's decoupled softmax or NGAME's triplet margin",
           choices=("decoupled-softmax", "triplet")),
    Option("tau", float, 0.05, "temperature of the decoupled softmax (DEXML: 0.05)", minimum=1e-4),
    Option("margin", float, 0.3, "margin of the triplet loss (NGAME: 0.3 for the encoder, 0.2 for the classifier)",
           minimum=0.0),
    Option("triplet_negatives", int, 10, "hardest negatives per positive in the triplet loss (NGAME: 10)", minimum=1),
    Option("free_vectors", bool, False, "add a free vector of its own to each label's text embedding (DEXA)"),
    Option("classifier", bool, False, "train a classifier vector per label in a stage named classifier (NGAME)"),
    Option("label_length", int, 0, "tokens of a label text (0: max_length)", minimum=0),
)
SAMPLER_OPTIONS = (
    Option("positives_per_document", int, 1, "positives each document draws at each step for the loss, shared "
           "in-batch (DEXML: 1; 0: all of them): a document of many labels then costs the label tower one text",
           minimum=0),
    Option("hard_negatives", int, 100, "labels of the current index each document draws its hard negatives from "
           "(DEXML: the top 100)", minimum=0),
    Option("negatives_per_document", int, 1, "hard negatives each document draws at each step, shared in-batch "
           "(DEXML: 1)", minimum=0),
    Option("mine_from_epoch", int, 5, "0-based epoch of each stage from which hard negatives are mined (DEXML: 5)",
           minimum=0),
    Option("refresh_every", int, 5, "epochs between two minings (NGAME and DEXML: 5)", minimum=1),
)
