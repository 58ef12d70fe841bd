"""Plain-autograd references that share no code with gradcache.py: the whole score matrix, materialized."""

import torch
import torch.nn.functional as F


def materialized_contrastive_loss(
    anchor,
    positive,
    *negatives,
    scale=20.0,
    similarity="cos",
    symmetric=False,
    matryoshka_dims=None,
    matryoshka_weights=None,
):
    """InfoNCE with in-batch negatives through the full B x N score matrix and `F.cross_entropy`.

    With `matryoshka_dims`, the weighted sum of the loss on each renormalized prefix.
    """
    columns = [anchor, positive, *negatives]
    if matryoshka_dims is not None:
        weights = matryoshka_weights or [1.0] * len(matryoshka_dims)
        return sum(
            weight
            * materialized_contrastive_loss(
                *[F.normalize(column[:, :dim], dim=-1) for column in columns],
                scale=scale,
                symmetric=symmetric,
            )
            for dim, weight in zip(matryoshka_dims, weights, strict=True)
        )
    if similarity == "cos":
        columns = [F.normalize(column, dim=-1) for column in columns]
    anchor, positive = columns[:2]
    labels = torch.arange(len(anchor), device=anchor.device)
    loss = F.cross_entropy(scale * anchor @ torch.cat(columns[1:]).T, labels)
    if symmetric:
        loss = (loss + F.cross_entropy(scale * positive @ anchor.T, labels)) / 2
    return loss
