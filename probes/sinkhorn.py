"""Log-domain Sinkhorn normalisation and Hungarian decoding for Level 2 (arrangement).

A Level 2 head scores every (mosaic position, arrangement slot) pair. Training pushes
the scores through :func:`log_sinkhorn` to a doubly-stochastic matrix restricted to the
present tiles and the valid slots, and applies :func:`permutation_loss`; at test time
:func:`hungarian_decode` turns scores into a hard assignment.

Masks: position ``p`` is valid when its tile shows a present organ; slot ``s`` is valid
when ``s < n_present`` (slots are numbered ``0..n_present-1`` by the builder). Rows and
columns of the valid block each sum to 1; everything outside it is exactly 0.
"""

from __future__ import annotations

import numpy as np

#: A large negative number standing in for log(0): finite, so gradients stay finite.
NEG = -1.0e4


def slot_mask(present_pos):
    """Valid-slot mask ``(B, S)``: slot ``s`` is valid when ``s < n_present`` of its sample."""
    import torch

    n = present_pos.sum(dim=-1, keepdim=True)
    slots = torch.arange(present_pos.shape[-1], device=present_pos.device)
    return slots[None, :] < n


def log_sinkhorn(scores, row_mask, col_mask, n_iters: int = 20, tau: float = 1.0):
    """Log of a doubly-stochastic matrix from ``scores`` ``(B, R, C)``, masked.

    Args:
        scores: unnormalised scores (torch tensor, any float dtype).
        row_mask: ``(B, R)`` bool, the rows that take part (present tiles).
        col_mask: ``(B, C)`` bool, the columns that take part; per sample the number of
            valid columns must equal the number of valid rows.
        n_iters: alternating row/column normalisations (default 20).
        tau: temperature; scores are divided by it first.

    Returns:
        ``(B, R, C)`` log-probabilities; masked entries hold :data:`NEG`.
    """
    import torch

    mask = row_mask[:, :, None] & col_mask[:, None, :]
    la = torch.where(mask, scores / tau, torch.full_like(scores, NEG))
    for _ in range(n_iters):
        la = la - torch.logsumexp(la, dim=2, keepdim=True)
        la = torch.where(mask, la, torch.full_like(la, NEG))
        la = la - torch.logsumexp(la, dim=1, keepdim=True)
        la = torch.where(mask, la, torch.full_like(la, NEG))
    return la


def permutation_loss(log_p, target_slot, row_mask):
    """Mean negative log-likelihood of each present tile's true slot under ``log_p``.

    ``target_slot`` is ``(B, R)`` int with -1 for absent tiles; absent rows are ignored.
    """

    safe = target_slot.clamp(min=0).long()
    picked = log_p.gather(2, safe[:, :, None])[:, :, 0]
    w = row_mask.to(picked.dtype)
    return -(picked * w).sum() / w.sum().clamp(min=1.0)


def hungarian_decode(scores: np.ndarray, present_pos: np.ndarray) -> np.ndarray:
    """Hard slots from scores with the Hungarian algorithm, over present tiles only.

    Args:
        scores: ``(N, 16, 16)`` position x slot scores (higher = more likely).
        present_pos: ``(N, 16)`` bool.

    Returns:
        ``(N, 16)`` int16: the slot given to each position; -1 for absent positions.
    """
    from scipy.optimize import linear_sum_assignment

    scores = np.asarray(scores, dtype=np.float64)
    present_pos = np.asarray(present_pos, dtype=bool)
    if scores.ndim != 3 or scores.shape[:2] != present_pos.shape:
        raise ValueError(
            f"hungarian_decode: scores {scores.shape} and present_pos {present_pos.shape} disagree"
        )
    out = np.full(present_pos.shape, -1, dtype=np.int16)
    for i in range(scores.shape[0]):
        rows = np.flatnonzero(present_pos[i])
        if rows.size == 0:
            continue
        block = scores[i][np.ix_(rows, np.arange(rows.size))]
        r, c = linear_sum_assignment(block, maximize=True)
        out[i, rows[r]] = c
    return out
