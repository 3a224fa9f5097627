"""Evaluation probes for frozen features: linear probe, weighted kNN, spectrum."""

from raycl.eval.knn import evaluate_knn, knn_accuracy
from raycl.eval.linear import (
    evaluate_linear,
    evaluate_linear_splits,
    linear_probe_accuracy,
    linear_probe_scores,
    torch_linear_probe_accuracy,
)
from raycl.eval.spectrum import effective_rank, singular_values

__all__ = [
    "effective_rank",
    "evaluate_knn",
    "evaluate_linear",
    "evaluate_linear_splits",
    "knn_accuracy",
    "linear_probe_accuracy",
    "linear_probe_scores",
    "singular_values",
    "torch_linear_probe_accuracy",
]
