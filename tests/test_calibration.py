"""Calibration of a flat recaller's logits per bin of training documents (xmcbench.calibration and
options.calibration=bins of `cluster-linear`): the fit recovers known scales, bins short of validation positives
share a fit, prediction reads the calibrated logits and training the plain ones, and a run saves what it fitted."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from safetensors.torch import load_file

from xmcbench.calibration import fit_bin_calibration
from xmcbench.config import Stage, TrainConfig
from xmcbench.errors import RefusedSetting, XmcError
from xmcbench.interfaces import EpochContext, LabelInfo
from xmcbench.metrics import frequency_bin_of
from xmcbench.registry import build_registry
from xmcbench.runs import launch
from xmcbench.runs.plan import plan_run
from xmcbench.testing import write_tiny_dataset
from xmcbench_lightxml.recaller import build_cluster_linear, check_cluster_linear

CALIBRATED = dataclasses.replace(TrainConfig(), cluster_size=1, validation_size=10, options={"calibration": "bins"})


def sampled(scales: dict[int, tuple[float, float]], counts: np.ndarray, documents: int, seed: int = 0):
    """(V, L) logits and 0/1 truth drawn so that label l is relevant with probability sigmoid(a z + c), (a, c) =
    scales[its frequency bin]."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(-2.0, 2.0, size=(documents, len(counts))).astype(np.float32)
    bins = frequency_bin_of(counts)
    a = np.array([scales[b][0] for b in bins], dtype=np.float32)
    c = np.array([scales[b][1] for b in bins], dtype=np.float32)
    truth = (rng.random(logits.shape) < 1 / (1 + np.exp(-(a * logits + c)))).astype(np.float32)
    return torch.from_numpy(logits), sp.csr_matrix(truth)


def test_the_fit_recovers_each_bins_scale_and_offset():
    counts = np.array([1, 1, 2, 3] * 3 + [5000, 2000, 1500])   # 12 labels seen 1-3 times, 3 seen over 1,000
    # the bins of 1 and 2-3 documents hold enough positives on their own: each gets its own fit
    truth_scales = {1: (1.5, 1.0), 2: (0.5, 0.0), 8: (0.5, -1.0)}
    logits, truth = sampled(truth_scales, counts, documents=6000)
    scales, offsets, lines = fit_bin_calibration(logits, truth, counts)
    for label, count in enumerate(counts):
        expected = truth_scales[int(frequency_bin_of(np.array([count]))[0])]
        assert (float(scales[label]), float(offsets[label])) == pytest.approx(expected, abs=0.1)
    assert len(lines) == 3 and lines[-1].startswith("labels of >3 training documents")   # the empty bins 4-1000 join it


def test_a_bin_short_of_positives_shares_its_neighbours_fit():
    counts = np.array([2] + [50] * 4)   # one label of 2-3 documents, four of 31-100: together, all bins
    logits, truth = sampled({2: (1.0, 0.0), 5: (1.0, 0.0)}, counts, documents=400, seed=1)
    truth = truth.tolil()
    truth[:, 0] = 0
    truth[:3, 0] = 1   # three positives: too few for a fit of its own
    scales, offsets, lines = fit_bin_calibration(logits, truth.tocsr(), counts)
    assert len(lines) == 1 and lines[0].startswith("all labels")
    assert float(scales[0]) == float(scales[1]) and float(offsets[0]) == float(offsets[1])


def test_too_few_positives_leave_the_logits_as_they_are():
    counts = np.array([1, 2, 3])
    truth = sp.csr_matrix(np.eye(3, dtype=np.float32))
    scales, offsets, lines = fit_bin_calibration(torch.zeros(3, 3), truth, counts)
    assert scales.tolist() == [1.0, 1.0, 1.0] and offsets.tolist() == [0.0, 0.0, 0.0] and lines == []


def validation_context(representations: torch.Tensor | None, truth: sp.csr_matrix | None,
                       counts: np.ndarray) -> EpochContext:
    size = len(counts)
    info = LabelInfo(tuple(f"l{i}" for i in range(size)), None, counts, np.ones(size))
    return EpochContext(Stage("joint"), None, 4, info, map_documents=None, map_labels=None, recalled_clusters=None,
                        encoder=type("E", (), {"out_dim": representations.shape[1] if representations is not None
                                               else 4})(),
                        final=True, validation_labels=truth,
                        map_validation=None if representations is None else lambda function, dim: representations)


def test_finalize_fits_on_the_validation_rows_and_only_prediction_reads_it():
    counts = np.array([1] * 8 + [3000] * 2)
    recaller = build_cluster_linear(CALIBRATED, 6, len(counts))
    representations = torch.randn(3000, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = recaller.logits(representations)
    # the rare labels are relevant far more often than their logits say, the frequent ones less
    truth_scales = {1: (1.0, 3.0), 8: (1.0, -3.0)}
    bins = frequency_bin_of(counts)
    shift = torch.tensor([truth_scales[b][1] for b in bins])
    truth = sp.csr_matrix((torch.rand(logits.shape, generator=torch.Generator().manual_seed(3))
                           < torch.sigmoid(logits + shift)).float().numpy())
    recaller.finalize(validation_context(representations, truth, counts))
    assert recaller.calibration_offsets[:8] == pytest.approx([3.0] * 8, abs=0.2)
    assert recaller.calibration_offsets[8:] == pytest.approx([-3.0] * 2, abs=0.2)
    sample = representations[:5]
    recaller.train()
    assert torch.equal(recaller(sample), recaller.logits(sample)), "training reads the plain logits"
    recaller.eval()
    with torch.no_grad():
        expected = recaller.logits(sample) * recaller.calibration_scales + recaller.calibration_offsets
        assert torch.allclose(recaller(sample), expected)
    resumed = build_cluster_linear(CALIBRATED, 6, len(counts))
    resumed.load_state_dict(recaller.state_dict())
    assert torch.equal(resumed.calibration_offsets, recaller.calibration_offsets), "the fit travels with the model"
    assert "calibration_scales" not in build_cluster_linear(TrainConfig(), 6, 3).state_dict(), \
        "runs without the option keep their tensors"
    with pytest.raises(XmcError, match="validation_size"):
        recaller.finalize(validation_context(None, None, counts))


def test_auto_calibrates_flat_runs_with_validation_rows_only():
    auto = dataclasses.replace(CALIBRATED, options={"calibration": "auto"})
    assert "calibration_scales" not in build_cluster_linear(dataclasses.replace(auto, validation_size=0), 6, 4) \
        .state_dict(), "without validation rows there is nothing to fit on"
    clustered = build_cluster_linear(auto, 6, 2)   # two clusters of four labels
    counts = np.full(4, 5000)
    representations = torch.randn(200, 6, generator=torch.Generator().manual_seed(4))
    truth = sp.csr_matrix((torch.rand(200, 4, generator=torch.Generator().manual_seed(5)) < 0.5).float().numpy())
    clustered.finalize(validation_context(representations, truth, counts))
    assert clustered.calibration_scales.tolist() == [1.0, 1.0] and clustered.calibration_offsets.tolist() == [0.0, 0.0]
    info = LabelInfo(("a", "b", "c", "d"), None, np.ones(4, dtype=np.int64), np.ones(4))
    check_cluster_linear(dataclasses.replace(auto, cluster_size=2, validation_size=0), info)


def test_calibration_on_label_clusters_or_without_validation_rows_is_refused():
    info = LabelInfo(("a", "b", "c", "d"), None, np.ones(4, dtype=np.int64), np.ones(4))
    check_cluster_linear(CALIBRATED, info)
    with pytest.raises(RefusedSetting, match="options.calibration=bins .* flat run"):
        check_cluster_linear(dataclasses.replace(CALIBRATED, cluster_size=2), info)
    with pytest.raises(RefusedSetting, match="options.calibration=bins .* --set validation_size=N"):
        check_cluster_linear(dataclasses.replace(CALIBRATED, validation_size=0), info)


def test_a_calibrated_run_fits_on_its_validation_rows_and_saves_the_fit(tiny_model_dir, tmp_path):
    registry = build_registry()
    data = write_tiny_dataset(tmp_path / "data", train=240, test=16)
    plan = plan_run(registry, "lightxml", str(data), set_options=[
        f"model_name={tiny_model_dir}", "pretrained_weights=false", "num_layers=2", "epochs=1", "max_length=32",
        "threads=1", "cluster_size=1", "validation_size=120", "options.calibration=bins"])
    launch.run(plan, tmp_path / "run", registry=registry, log=lambda line: None)
    weights = load_file(tmp_path / "run" / "model" / "weights.safetensors")
    fitted = torch.stack([weights["recaller.calibration_scales"] - 1, weights["recaller.calibration_offsets"]])
    assert fitted.abs().max() > 1e-3, "the fit on the validation rows moved the logits"
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert 0 <= metrics["P@1"] <= 100
