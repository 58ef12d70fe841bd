"""Plain-autograd references that share no code with gradcache.py: the whole score matrix, materialized."""

from collections.abc import Mapping

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


class StageOneRecorder:
    """A reference for dropout that does not reuse gradcache's chunk plan: it watches what stage 1 encoded.

    `step` runs `gradcache_step` with its callables wrapped: every encoder call records the CPU RNG state
    before it and the inputs it received, each with the rows (column, indices) that `select` picked for it,
    until the loss is called (stage 2). `replay` then re-encodes exactly those inputs with reference
    encoders, each call from its recorded RNG state (so dropout draws the same masks), puts the
    representations in batch order, and back-propagates the full-batch loss through that one graph.
    Whatever plan, grouping or padding gradcache chose, the parameter gradients must equal this one's.
    """

    def __init__(self):
        self.calls, self.selected, self.recording = [], [], True

    def step(self, encoders, columns, loss_fn, *args, select=None, encode_group=None, **options):
        from gradcache import gradcache_step, select_examples

        self.batch_sizes = [len(c["attention_mask"]) if isinstance(c, Mapping) else len(c) for c in columns]
        selects = select if isinstance(select, (list, tuple)) else [select or select_examples] * len(columns)
        options["select"] = [self.watch_select(c, chosen) for c, chosen in enumerate(selects)]
        if encode_group is not None:
            options["encode_group"] = self.watch_call(lambda inputs, columns: encode_group(inputs, columns))
        elif isinstance(encoders, (list, tuple)):
            encoders = [self.watch_call(encoder) for encoder in encoders]
        else:
            encoders = self.watch_call(encoders)

        def watched_loss(*reps, **kwargs):
            self.recording = False
            return loss_fn(*reps, **kwargs)

        return gradcache_step(encoders, columns, watched_loss, *args, **options)

    def watch_select(self, column, select):
        def selecting(data, index):
            chosen = select(data, index)
            if self.recording:
                copied = dict(chosen) if isinstance(chosen, Mapping) else chosen  # models add keys to it
                self.selected.append((column, index.clone(), copied))
            return chosen

        return selecting

    def watch_call(self, encoder):
        def encoding(inputs, *rest):
            if self.recording:
                count = len(inputs) if rest else 1  # a group call receives a list of inputs
                self.calls.append((torch.get_rng_state(), self.selected[:count]))
                del self.selected[:count]
            return encoder(inputs, *rest)

        return encoding

    def replay(self, encoders, loss_fn):
        """The reference loss, back-propagated; `encoders`: one per column (copies of the trained ones)."""
        pieces = [[] for _ in self.batch_sizes]
        with torch.random.fork_rng():
            for rng_state, entries in self.calls:
                torch.set_rng_state(rng_state)
                for column, index, inputs in entries:
                    output = encoders[column](inputs)
                    rep = output["sentence_embedding"] if isinstance(output, Mapping) else output
                    pieces[column].append((index, rep))
        reps = []
        for size, column_pieces in zip(self.batch_sizes, pieces, strict=True):
            rows = torch.cat([index for index, _ in column_pieces])
            assert sorted(rows.tolist()) == list(range(size)), "stage 1 must encode every row exactly once"
            reps.append(torch.cat([rep for _, rep in column_pieces])[torch.argsort(rows)])
        loss = loss_fn(*reps)
        loss.backward()
        return loss.detach()
