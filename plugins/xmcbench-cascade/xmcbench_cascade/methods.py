"""The `cascade` method: CascadeXML's multi-resolution training (Kharbanda et al., NeurIPS 2022) on xmcbench's
label tree, with its published settings as presets and a rule that derives the tree for any other dataset.

Where each preset value comes from (xmc-aalto/cascadexml at commit ce701f6; the repository publishes settings
for three datasets only, as command lines in README.md lines 19, 26 and 30; the rest are src/main.py's
defaults):
- tree: levels of 2^10, 2^13, 2^16 nodes above the labels (`--tree_depth` default [10, 13, 16],
  src/main.py:172; each level splits the one above in 8, src/tree.py:154-177) -> tree_levels = (1024, 8192)
  with num_clusters = 65536 leaf clusters. Wiki10-31K runs 3 levels (two top-k values): one tree level.
- nodes kept per level (`--topk`): Amazon-670K 128, 256, 400; Wiki-500K 128, 256, 512; Wiki10-31K 64, 64
  -> level_top = all but the last, top_clusters = the last.
- max_length (`--maxlen`): 128, 128, 256; batch 64 and 15 epochs (all three commands); encoder lr 1e-4 and
  heads at 10x (src/Runner.py:160-172) -> lr 1e-4, head_lr 1e-3; weight decay 0.05 (src/main.py:159).
- per-level dropout (`--embed_drops`): 0.2,0.25,0.4,0.5 (Amazon-670K), 0.2,0.25,0.35,0.5 (Wiki-500K),
  0.3,0.3,0.4 (Wiki10-31K).
- layers per level: [CLS] of layers 5-6, 8, 10, 12 for four levels, 7-8, 10, 12 for three
  (src/CascadeXML.py:75-80) -> derived by transformer-levels from the encoder's depth.
- encoder: bert-base-uncased (src/main.py:144); no SWA, no validation split in the published code.

The heads' learning rate 1e-3 belongs with the presets' 15 epochs: a dataset without a preset trains for the
epochs the core derives (3 to 10) and so also takes the core's derived head_lr (1e-2). On a 5,000-document cut
of debian-builddeps (length 64, seed 0), cascade's validation P@5 after epochs 1-3 was 27.7, 38.7, 44.4 at 1e-3
and 43.6, 48.6, 49.2 at 1e-2 (LightXML's: 37.8, 49.0, 50.1).
"""

from __future__ import annotations

from xmcbench.config import MethodSpec
from xmcbench.defaults import Derived, DeviceFacts, DatasetStatistics

LEAF_SIZE = 8          # labels per leaf cluster (CascadeXML: about 8 at Wiki-500K, 10 at Amazon-670K)
BRANCHING = 8          # children per node between levels (2^3, as --tree_depth [10, 13, 16])
MIN_TOP_NODES = 16     # a level with fewer nodes than this adds nothing: the recaller scores every node anyway
MAX_TREE_LEVELS = 2    # CascadeXML's four scoring levels: recaller, two tree levels, labels

CASCADE_DEFAULTS = {
    "encoder": "transformer-levels",
    "recaller": "cluster-linear",
    "ranker": "node-linear",
    "sampler": "dynamic",
    "model_name": "sentence-transformers/all-MiniLM-L6-v2",
    "cluster_size": LEAF_SIZE,
    "dropout": 0.3,
    "lr": 1e-4,
    "weight_decay": 0.05,
}

PAPER_SETTINGS = {"model_name": "bert-base-uncased", "batch_size": 64, "epochs": 15, "swa": False,
                  "lr": 1e-4, "head_lr": 1e-3, "weight_decay": 0.05}

PRESETS = {
    "amazon670k": {**PAPER_SETTINGS, "num_clusters": 65536, "tree_levels": (1024, 8192), "level_top": (128, 256),
                   "top_clusters": 400, "max_length": 128,
                   "options": {"level_dropout": "0.2,0.25,0.4,0.5"}},
    "wiki500k": {**PAPER_SETTINGS, "num_clusters": 65536, "tree_levels": (1024, 8192), "level_top": (128, 256),
                 "top_clusters": 512, "max_length": 128,
                 "options": {"level_dropout": "0.2,0.25,0.35,0.5"}},
    "wiki10-31k": {**PAPER_SETTINGS, "num_clusters": 4096, "tree_levels": (512,), "level_top": (64,),
                   "top_clusters": 64, "max_length": 256,
                   "options": {"level_dropout": "0.3,0.3,0.4"}},
}


def tree_for(num_labels: int) -> tuple[int, tuple[int, ...], tuple[int, ...], int]:
    """(num_clusters, tree_levels, level_top, top_clusters) for L labels: leaf clusters of about LEAF_SIZE
    labels, up to MAX_TREE_LEVELS levels above them, each BRANCHING times coarser, of at least MIN_TOP_NODES
    nodes; each level keeps 128 * 2^i nodes (CascadeXML's 128, 256 at Wiki-500K) but at most a quarter of
    them, and the leaf level twice the last (512), at most a quarter of the leaf clusters."""
    from xmcbench.indexing import num_clusters_for   # torch: imported when a plan derives a tree, not at load

    leaves = num_clusters_for(num_labels, LEAF_SIZE)
    levels = tuple(sorted(leaves // BRANCHING ** i for i in range(1, MAX_TREE_LEVELS + 1)
                          if leaves // BRANCHING ** i >= MIN_TOP_NODES))
    keep = tuple(max(1, min(128 * 2 ** i, nodes // 4)) for i, nodes in enumerate(levels))
    top_clusters = max(1, min(2 * keep[-1] if keep else 128, leaves // 4))
    return leaves, levels, keep, top_clusters


def derive_tree(statistics: DatasetStatistics, device: DeviceFacts) -> dict[str, Derived]:
    """The tree above the leaf clusters of a dataset without a preset (see tree_for). The leaf clusters
    themselves come from cluster_size, LEAF_SIZE by default (the method's defaults), which gives tree_for's
    number of leaves: derived as num_clusters, they would override a cluster_size the user sets (--set
    cluster_size=2), which must win over anything derived."""
    leaves, levels, keep, top_clusters = tree_for(statistics.labels)
    source = f"labels = {statistics.labels}"
    return {
        "tree_levels": Derived(levels, source, f"up to {MAX_TREE_LEVELS} levels above the leaf clusters of about "
                                               f"{LEAF_SIZE} labels ({leaves}), each {BRANCHING}x coarser, of at "
                                               f"least {MIN_TOP_NODES} nodes"),
        "level_top": Derived(keep, source, "128, 256 nodes kept (CascadeXML at Wiki-500K), at most a quarter "
                                           "of a level"),
        "top_clusters": Derived(top_clusters, source, "twice the last level's, at most a quarter of the leaves"),
    }


def cascade_methods() -> list[MethodSpec]:
    return [MethodSpec(
        name="cascade",
        description="CascadeXML-style: a label tree of several levels, each scored from its own layers of one "
                    "transformer, candidates chained from level to level, trained end to end",
        defaults=CASCADE_DEFAULTS,
        presets=PRESETS,
        derive=derive_tree,
        needs_ranker=True,
    )]
