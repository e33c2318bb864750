"""Deprecated: the run layer moved out of this module. It re-exports the former names for one release, with a
DeprecationWarning on import; import from the new homes instead:

    xmcbench.runs.plan     Plan, plan_run, plan_resume, check_settings, declared_options, provenance
    xmcbench.runs.splits   training_pool, split_train_rows, training_view
    xmcbench.runs.launch   run, continues_from_scratch
    xmcbench.formats       open_dataset
    xmcbench.indexing      resolve_num_clusters, label_clusters
    xmcbench.scoring       propensities, score, remap_labels, evaluation_config, evaluate_predictions, ...
    xmcbench.rundir        FINISHED_MARKER, is_finished, write_results, save_predictions_npz, reading_of, ...
    xmcbench.models        load_model (was load_saved_model), predict_documents (was predict_saved_model)
    xmcbench.saved         load, evaluate (was evaluate_run), predict_texts, rescore_run
"""

import warnings

from xmcbench.data import IN_MEMORY
from xmcbench.formats import open_dataset
from xmcbench.indexing import label_clusters, resolve_num_clusters
from xmcbench.models import load_model as load_saved_model, predict_documents as predict_saved_model, \
    saved_zero_shot_mask, test_documents
from xmcbench.rundir import FINISHED_MARKER, PREDICTIONS_NPZ, VALIDATION_PREDICTIONS_FILE, environment, \
    is_finished, labels_file_of, reading_of, save_predictions, save_predictions_npz, \
    save_validation_predictions, write_results
from xmcbench.runs.launch import continues_from_scratch, run
from xmcbench.runs.plan import Plan, check_settings, declared_options, plan_resume, plan_run
from xmcbench.runs.splits import split_train_rows, training_pool, training_view
from xmcbench.saved import evaluate as evaluate_run, keep_scores_at_least, predict_texts, rescore_run
from xmcbench.scoring import EVALUATION_SETTINGS, Propensities, evaluate_predictions, evaluation_config, \
    filtered_pairs, label_document_counts, propensities, ranked_labels, remap_labels, score, \
    without_filtered_pairs, write_external_run, zero_shot_mask

__all__ = ["EVALUATION_SETTINGS", "FINISHED_MARKER", "IN_MEMORY", "PREDICTIONS_NPZ", "Plan", "Propensities",
           "VALIDATION_PREDICTIONS_FILE", "check_settings", "continues_from_scratch", "declared_options",
           "environment", "evaluate_predictions", "evaluate_run", "evaluation_config", "filtered_pairs",
           "is_finished", "keep_scores_at_least", "label_clusters", "label_document_counts", "labels_file_of",
           "load_saved_model", "open_dataset", "plan_resume", "plan_run", "predict_saved_model", "predict_texts",
           "propensities", "ranked_labels", "reading_of", "remap_labels", "rescore_run", "resolve_num_clusters",
           "run", "save_predictions", "save_predictions_npz", "save_validation_predictions", "saved_zero_shot_mask",
           "score", "split_train_rows", "test_documents", "training_pool", "training_view",
           "without_filtered_pairs", "write_external_run", "write_results", "zero_shot_mask"]

warnings.warn("xmcbench.runner is deprecated and goes in the next release; import from xmcbench.runs, "
              "xmcbench.scoring, xmcbench.rundir, xmcbench.models or xmcbench.saved (this module's docstring "
              "lists where each name went)", DeprecationWarning, stacklevel=2)
