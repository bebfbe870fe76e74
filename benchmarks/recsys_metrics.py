"""Scores of a recommender's predictions: log-loss, ROC AUC, RMSE, and what a model that
learned nothing would score (the base rate, the mean rating)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def log_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of ``logits`` ``(n,)`` against 0/1 ``labels`` ``(n,)``."""
    return F.binary_cross_entropy_with_logits(logits.double(), labels.double()).item()


def base_rate_log_loss(train_labels: torch.Tensor, labels: torch.Tensor) -> float:
    """The log-loss on ``labels`` of always predicting the train split's positive rate."""
    p = train_labels.double().mean().clamp(1e-12, 1 - 1e-12)
    return log_loss(torch.full_like(labels, math.log(p / (1 - p)), dtype=torch.float64), labels)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC: the probability that a random positive scores above a random negative
    (ties count half), from the ranks of the scores (Mann-Whitney U); ``nan`` when one class
    is missing."""
    scores, labels = scores.double().flatten(), labels.flatten() > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return math.nan
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()            # tied scores share their mean rank
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    u = ranks[labels].sum().item() - positives * (positives + 1) / 2
    return u / (positives * negatives)


def rmse(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    return (predictions.double() - targets.double()).pow(2).mean().sqrt().item()
