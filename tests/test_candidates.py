import torch

from xmcbench.candidates import candidates_with_positives, positive_targets, unique_per_row
from xmcbench.interfaces import LabelClusters
from xmcbench_lightxml.sampler import DynamicSampler


def clusters_of(assignment):
    assignment = torch.as_tensor(assignment)
    return LabelClusters.from_assignment(assignment, int(assignment.max()) + 1)


def test_label_clusters_round_trip():
    clusters = clusters_of([1, 0, 1, 2, 0, 1])
    assert clusters.cluster_labels.tolist() == [[1, 4, -1], [0, 2, 5], [3, -1, -1]]
    assert not clusters.is_flat
    assert clusters_of([0, 1, 2]).is_flat


def test_unique_per_row_drops_repeats_and_invalid():
    ids, keep = unique_per_row(torch.tensor([[3, 1, 3, 2]]), torch.tensor([[True, True, True, False]]))
    assert ids[keep].tolist() == [1, 3]


def test_positive_targets_without_dense_label_vector():
    targets = positive_targets(torch.tensor([[5, 2, 9, 0]]), torch.tensor([[9, 2, -1]]))
    assert targets.tolist() == [[0.0, 1.0, 1.0, 0.0]]


def test_dynamic_sampler_keeps_every_positive_once():
    torch.manual_seed(0)
    num_labels, num_clusters = 64, 16
    clusters = clusters_of(torch.randperm(num_labels) % num_clusters)
    sampler = DynamicSampler(top_clusters=3)
    for _ in range(20):
        logits = torch.randn(4, num_clusters)
        positives = torch.full((4, 6), -1)
        for row in range(4):
            chosen = torch.randperm(num_labels)[: torch.randint(1, 7, ()).item()]
            positives[row, : len(chosen)] = chosen
        candidates = sampler(logits, positives, clusters, torch.arange(4))
        top = logits.topk(3, dim=1).indices
        for row in range(4):
            labels = candidates.labels[row][candidates.mask[row]].tolist()
            assert len(labels) == len(set(labels)), "a label appears twice"
            positive = set(positives[row][positives[row] >= 0].tolist())
            assert positive <= set(labels), "a positive is missing"
            expected = {l for l in labels if l in positive}
            got = set(candidates.labels[row][candidates.targets[row] > 0].tolist())
            assert got == expected
            recalled = set(clusters.label_cluster[labels].tolist())
            assert set(top[row].tolist()) <= recalled, "top clusters must be candidates"
            assert (candidates.clusters[row][candidates.mask[row]] == clusters.label_cluster[labels]).all()


def test_candidates_follow_the_recaller():
    clusters = clusters_of([0, 0, 1, 1, 2, 2])
    logits = torch.tensor([[0.0, 5.0, -1.0]])
    candidates = candidates_with_positives(logits.topk(1).indices, torch.tensor([[4]]), clusters)
    assert sorted(candidates.labels[candidates.mask].tolist()) == [2, 3, 4, 5]
