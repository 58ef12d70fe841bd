"""Plain-autograd references that share no code with gradcache.py (the whole score matrix, materialized), and
the one rule every exactness test applies: a run is exact when it is as close to the float64 truth as the
float32 reference itself is.

A float32 reference and a float32 run round differently (other reduction orders, other kernels, other CPUs),
and how much depends on the conditioning of the loss: a fixed 1e-5 between two float32 computations measures
that rounding, not exactness, and fails on another machine. So each exactness test computes its reference
twice, in float32 and in float64 (the same initial weights cast to double, the same inputs), and passes when

    error(run, float64) <= ROUNDING_MULTIPLE * error(float32 reference, float64) + FLOOR

where error is max|x - truth| / max|truth| over every entry (one denominator per quantity: a loss, the
gradients of all parameters, the updates of all weights). FLOOR is about 8 float32 ulps. A real defect (a lost
chunk, a gradient scaled by 1 + 1e-4, a dropped mask entry) sits far above it, which each kind's negative
control shows.
"""

import contextlib
import copy
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

ROUNDING_MULTIPLE = 4
FLOOR = 1e-6


def leaves(values):
    """The tensors and numbers of a nested structure (lists, tuples, dicts by key), in a fixed order."""
    if isinstance(values, Mapping):
        return [leaf for key in sorted(values) for leaf in leaves(values[key])]
    if isinstance(values, (list, tuple)):
        return [leaf for value in values for leaf in leaves(value)]
    return [torch.as_tensor(values, dtype=torch.float64).detach().cpu()]


def relative_error(values, truth):
    """max|value - truth| / max|truth| over every entry of two structures of the same shape."""
    values, truth = leaves(values), leaves(truth)
    assert len(values) == len(truth), (len(values), len(truth))
    largest = max(float(t.abs().max()) for t in truth if t.numel())
    pairs = [(v.double(), t) for v, t in zip(values, truth, strict=True) if t.numel()]
    difference = max(float((v - t).abs().max()) for v, t in pairs)
    return difference / largest


@dataclasses.dataclass(frozen=True)
class Exactness:
    error: float  # the run against float64
    e_ref: float  # the float32 reference against float64

    @property
    def bound(self):
        return ROUNDING_MULTIPLE * self.e_ref + FLOOR

    @property
    def holds(self):
        return self.error <= self.bound

    def __str__(self):
        return f"{self.error:.1e} (float32 reference {self.e_ref:.1e}, bound {self.bound:.1e})"


def exactness(run, reference32, reference64):
    """How far `run` is from the float64 truth, beside how far the float32 reference is."""
    return Exactness(relative_error(run, reference64), relative_error(reference32, reference64))


def assert_exact(run, reference32, reference64, what="result"):
    """The rule (see the module docstring); returns the Exactness for printing."""
    measured = exactness(run, reference32, reference64)
    assert measured.holds, f"{what}: {measured}"
    return measured


def assert_inexact(run, reference32, reference64, what="wrong run"):
    """A negative control: a deliberately wrong run must fail the same rule."""
    measured = exactness(run, reference32, reference64)
    assert not measured.holds, f"{what} passed the rule: {measured}"
    return measured


def parameter_gradients(*modules):
    """{(module index, parameter name): gradient} of every parameter that has one."""
    return {
        (index, name): p.grad
        for index, module in enumerate(modules)
        for name, p in module.named_parameters()
        if p.grad is not None
    }


def float64(values):
    """A float64 copy: floating tensors cast to double (leaf tensors keep requires_grad), modules deep-copied
    and cast; integer tensors, strings and other values as they are."""
    if isinstance(values, torch.nn.Module):
        return copy.deepcopy(values).double()
    if isinstance(values, torch.Tensor):
        if not values.is_floating_point():
            return values
        return values.detach().double().requires_grad_(values.requires_grad)
    if isinstance(values, Mapping):
        return type(values)({key: float64(value) for key, value in values.items()})
    if isinstance(values, (list, tuple)):
        return type(values)(float64(value) for value in values)
    return values


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


def plain_rows(column, index):
    """Rows `index` of a column by a plain rule (what the chunk of those rows holds, tokenized alone): a
    tensor's rows; a dict's tensors' rows, the positions at either end that no selected row attends to left
    out; other values as they are; a list's items."""
    if isinstance(column, torch.Tensor):
        return column[index]
    if not isinstance(column, Mapping):
        return [column[i] for i in index.tolist()]
    rows = {k: v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in column.items()}
    mask = column.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and rows["attention_mask"].any():
        attended = rows["attention_mask"].any(dim=0).nonzero().flatten().tolist()
        kept = slice(attended[0], attended[-1] + 1)
        for key, value in rows.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == mask.shape[1]:
                rows[key] = value[:, kept]
    return rows


def same_rows(chosen, plain):
    if isinstance(plain, Mapping):
        return sorted(chosen) == sorted(plain) and all(same_rows(chosen[k], plain[k]) for k in plain)
    if isinstance(plain, torch.Tensor):
        return isinstance(chosen, torch.Tensor) and chosen.shape == plain.shape and torch.equal(chosen, plain)
    return chosen == plain


class StageOneRecorder:
    """A reference for dropout that does not reuse gradcache's chunk plan: it watches what stage 1 encoded.

    `step` runs `gradcache_step` with its callables wrapped: every encoder call records the CPU RNG state
    before it and the inputs it received, each with the rows (column, indices) that `select` picked for it,
    until the loss is called (stage 2). `replay` then re-encodes those rows with reference encoders, each
    call from its recorded RNG state (so dropout draws the same masks), puts the representations in batch
    order, and back-propagates the full-batch loss through that one graph. Whatever plan, grouping or
    padding gradcache chose, the parameter gradients must equal this one's. Without a `select` of the
    caller's, the rows replayed are plain_rows' of the batch, never gradcache's selection, which must hold
    the same (select_examples checked by a rule of its own).
    """

    def __init__(self):
        self.calls, self.selected, self.recording = [], [], True

    def step(self, encoders, columns, loss_fn, *args, select=None, encode_group=None, **options):
        from gradcache import gradcache_step, select_examples

        self.batch_sizes = [len(c["attention_mask"]) if isinstance(c, Mapping) else len(c) for c in columns]
        selects = select if isinstance(select, (list, tuple)) else [select or select_examples] * len(columns)
        self.own_select = select is None  # the rows to replay: plain_rows'
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
                if self.own_select:
                    copied = plain_rows(data, index)
                    assert same_rows(chosen, copied), f"column {column}: rows {index.tolist()} selected apart"
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


def masked_contrastive_loss(anchor, positive, *negatives, scale=20.0, symmetric=False, ids=None, margin=None,
                            relative=False, other_positives=None):  # fmt: skip
    """InfoNCE (cosine) through the full score matrix, with false negatives masked by a direct rule, entry
    by entry: returns (loss, fraction of non-target candidates masked).

    Row i's candidate j (never its own target) is masked when its text repeats row i's positive, when it is
    the positive of a row whose anchor repeats row i's anchor, or when its similarity exceeds row i's
    positive similarity + margin (x margin if relative), or when its text is one of `other_positives[i]`
    (row i's other right answers). The reverse direction (positive i against every anchor j) masks an anchor
    that repeats anchor i, whose positive repeats positive i, or among whose other positives positive i is,
    and the same margin.
    """
    columns = [F.normalize(column, dim=-1) for column in (anchor, positive, *negatives)]
    anchor, positive = columns[:2]
    batch = len(anchor)
    candidates = torch.cat(columns[1:])
    id_of = None if ids is None else [int(i) for column in ids[1:] for i in column]  # candidate ids
    positive_similarity = (anchor * positive).sum(dim=-1).detach()

    def threshold(i):
        return positive_similarity[i] * margin if relative else positive_similarity[i] + margin

    def masked(similarity, i, j, is_duplicate):
        if j == i:
            return False
        return bool(ids is not None and is_duplicate(i, j)) or bool(
            margin is not None and similarity > threshold(i)
        )

    others = [[int(i) for i in row] for row in other_positives] if other_positives is not None else None

    def forward_duplicate(i, j):
        repeated = id_of[j] == int(ids[1][i]) or (j < batch and int(ids[0][j]) == int(ids[0][i]))
        return repeated or (others is not None and id_of[j] in others[i])

    def reverse_duplicate(i, j):
        repeated = int(ids[0][j]) == int(ids[0][i]) or int(ids[1][j]) == int(ids[1][i])
        return repeated or (others is not None and int(ids[1][i]) in others[j])

    directions = [(anchor, candidates, forward_duplicate)]
    if symmetric:
        directions.append((positive, anchor, reverse_duplicate))
    losses, masked_count, seen = [], 0, 0
    labels = torch.arange(batch)
    for queries, keys, is_duplicate in directions:
        similarity = queries @ keys.T
        mask = torch.tensor(
            [[masked(similarity[i, j], i, j, is_duplicate) for j in range(len(keys))] for i in range(batch)]
        )
        losses.append(F.cross_entropy((scale * similarity).masked_fill(mask, -torch.inf), labels))
        masked_count, seen = masked_count + int(mask.sum()), seen + batch * (len(keys) - 1)
    return sum(losses) / len(losses), masked_count / seen


def reference_objective(anchor, positive, *negatives, texts, in_batch=True, symmetric=False,
                        matryoshka_dims=None, scale=20.0, positives_of=None, margin=None, teacher=None,
                        distill_weight=1.0, temperature=1.0, guide=None, guide_margin=0.0,
                        similarity="cos"):  # fmt: skip
    """Every loss of train.py on cosine scores (or dot products: `similarity="dot"`, no normalization), from
    the definitions, through the materialized score matrix.

    Each anchor's candidates are every positive and hard negative of the batch (`in_batch`), or only its
    own positive and hard negatives. A candidate other than its own positive is masked, entry by entry, when
    its text is a right answer of the anchor's text (`positives_of[anchor text]`: every positive that text
    has in the data), or its similarity exceeds the positive's + `margin`. The reverse direction
    (`symmetric`: positive i against every anchor) masks anchors with the same text as anchor i, or of which
    positive i is a right answer, and the same margin. With `matryoshka_dims`, the sum over the renormalized
    prefixes. `teacher` (rows x group scores) adds distill_weight x KL(teacher softmax || student softmax)
    at `temperature` over each anchor's own group, on the full representations, averaged over the rows.
    `guide` (a guide model's representations of every column) masks, in both directions, what the guide
    scores (cosine) above its score of the row's anchor and positive + `guide_margin`.
    texts: the texts of every column, to read the masks from.
    """
    columns = [anchor, positive, *negatives]
    rows, groups = len(anchor), len(columns) - 1
    anchor_texts, positive_texts = texts[0], texts[1]

    def right_answer(anchor_text, text):
        return positives_of is not None and text in positives_of.get(anchor_text, ())

    guide = None if guide is None else [F.normalize(g.float(), dim=-1) for g in guide]

    def guide_score(query, i, key, j):
        return float(guide[query][i] @ guide[key][j])

    def guided(i, query, key, j):  # (column, row) of the query and of the key
        return guide is not None and guide_score(query, i, key, j) > guide_score(0, i, 1, i) + guide_margin

    def cross_entropy(scores, targets, is_masked, is_guided):
        similarity = scores.detach()

        def masked(i, j):
            above = margin is not None and bool(similarity[i, j] > similarity[i, targets[i]] + margin)
            return j != targets[i] and (is_masked(i, j) or above or is_guided(i, j))

        mask = torch.tensor([[masked(i, j) for j in range(scores.shape[1])] for i in range(len(scores))])
        return F.cross_entropy((scale * scores).masked_fill(mask, -torch.inf), torch.tensor(targets))

    def one_size(anchor, positive, *negatives):
        if not in_batch:
            group = torch.stack([positive, *negatives], dim=1)  # rows x (1 + k) x d
            scores = (anchor[:, None, :] * group).sum(-1)
            return cross_entropy(
                scores,
                [0] * rows,
                lambda i, j: right_answer(anchor_texts[i], texts[1 + j][i]),
                lambda i, j: guided(i, 0, 1 + j, i),
            )
        candidate_texts = [text for column in texts[1:] for text in column]
        loss = cross_entropy(
            anchor @ torch.cat([positive, *negatives]).T,
            list(range(rows)),
            lambda i, j: right_answer(anchor_texts[i], candidate_texts[j]),
            lambda i, j: guided(i, 0, 1 + j // rows, j % rows),
        )
        if not symmetric:
            return loss
        reverse = cross_entropy(
            positive @ anchor.T,
            list(range(rows)),
            lambda i, j: (
                anchor_texts[j] == anchor_texts[i] or right_answer(anchor_texts[j], positive_texts[i])
            ),
            lambda i, j: guided(i, 1, 0, j),
        )
        return (loss + reverse) / 2

    def unit(column):
        return F.normalize(column, dim=-1) if similarity == "cos" else column

    dims = matryoshka_dims or [anchor.shape[-1]]
    loss = sum(one_size(*[unit(column[:, :dim]) for column in columns]) for dim in dims)
    if teacher is not None:
        anchor, *candidates = [unit(column) for column in columns]
        student = torch.stack([scale * (anchor * column).sum(-1) for column in candidates], 1) / temperature
        target = torch.softmax(torch.as_tensor(teacher, dtype=student.dtype) / temperature, dim=1)
        kl = (target * (target.log() - torch.log_softmax(student, dim=1))).sum(1)
        assert kl.shape == (rows,) and target.shape[1] == groups
        loss = loss + distill_weight * kl.mean()
    return loss


def teacher_of(path, first_only=False, swapped=False):
    """{(anchor, positive): [its score, the negatives'...]} read from the raw JSON lines of `path` with json
    (FlagEmbedding's fields: anchor, positive a text or a list, pos_scores, neg_scores). Wrong paths:
    `first_only`, every positive with the first one's score; `swapped`, the two fields' scores exchanged
    (the negative's score given to the positive: one negative)."""
    scores = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        positives = record["positive"] if isinstance(record["positive"], list) else [record["positive"]]
        for place, positive in enumerate(positives):
            row = [record["pos_scores"][0 if first_only else place], *record["neg_scores"]]
            scores[record["anchor"], positive] = row[::-1] if swapped else row
    return scores


def retrieval_evaluator(path, kind="dense"):
    """sentence-transformers' retrieval evaluator of the model's `kind` ("dense", "multi-vector") on the raw
    JSON lines of a dev file, read with json: each record's anchor a query, the distinct positives the corpus,
    each anchor's own positives relevant; named "dev", the metrics at the cut-offs train.py logs, no
    prompts."""
    from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    records = [json.loads(line) for line in Path(path).read_text().splitlines()]
    positives = [r["positive"] if isinstance(r["positive"], list) else [r["positive"]] for r in records]
    ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(t for texts in positives for t in texts))}
    evaluator = {
        "dense": InformationRetrievalEvaluator,
        "multi-vector": MultiVectorInformationRetrievalEvaluator,
    }
    return evaluator[kind](
        queries={f"q{i}": record["anchor"] for i, record in enumerate(records)},
        corpus={doc_id: text for text, doc_id in ids.items()},
        relevant_docs={f"q{i}": {ids[text] for text in texts} for i, texts in enumerate(positives)},
        mrr_at_k=[10], ndcg_at_k=[10], accuracy_at_k=[1, 10], precision_recall_at_k=[1, 10], map_at_k=[10],
        name="dev", write_csv=False, query_prompt="", corpus_prompt="",
    )  # fmt: skip


@contextlib.contextmanager
def maxsim_kept_in_float64():
    """sentence-transformers' MaxSim as it is, but for one cast: its kernel (`_maxsim_score_documents`) takes
    the per-token maxima to float32 (to keep bf16 sums apart), which would round a float64 reference to
    float32. Inside, the same kernel keeps its input's dtype; the loss, colbert_scores, maxsim's chunks and
    masks around it stay sentence-transformers' own."""
    from sentence_transformers.util import similarity

    original = similarity._maxsim_score_documents

    def kernel(a, b, a_mask, b_mask):
        scores = torch.einsum("ash,bth->abst", a, b)
        if b_mask is not None:
            scores.masked_fill_(~b_mask.bool().unsqueeze(0).unsqueeze(2), torch.finfo(scores.dtype).min)
        scores = scores.max(dim=-1).values
        if a_mask is not None:
            scores = scores * a_mask.unsqueeze(1)
        return scores.sum(dim=-1)

    similarity._maxsim_score_documents = kernel
    try:
        yield
    finally:
        similarity._maxsim_score_documents = original


def maxsim_distilled_loss(model, teacher, distill_weight, temperature, scale=1.0):
    """`loss(features, labels=None)`, called as sentence-transformers' losses are: its
    MultiVectorMultipleNegativesRankingLoss (at `scale`) on the whole batch, plus distill_weight x the mean
    over the anchors of `maxsim_group_kl` (the model's token embeddings and scoring masks). `teacher`:
    B x (1 + k)."""
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    in_batch = MultiVectorMultipleNegativesRankingLoss(model, scale=scale)

    def loss(features, labels=None):
        tasks = ["query"] + ["document"] * (len(features) - 1)
        outputs = [model(dict(f), task=f.get("task", t)) for f, t in zip(features, tasks, strict=True)]
        vectors = [output["token_embeddings"] for output in outputs]
        masks = [output["attention_mask"].bool() for output in outputs]
        kl = maxsim_group_kl(vectors, masks, teacher, temperature, scale)
        with maxsim_kept_in_float64():
            return in_batch(features) + distill_weight * kl.mean()

    return loss


def maxsim_group_kl(vectors, masks, teacher, temperature, scale=1.0):
    """Per anchor, KL(softmax(teacher / T) || softmax(scale MaxSim / T)) over its own group (its positive,
    then its hard negatives), T the temperature, in plain torch on sentence-transformers' colbert_scores of
    the whole batch (B x B(1 + k), query-major: row i's group is columns i(1 + k) to (i + 1)(1 + k) - 1),
    read off that matrix, in the kernel's own dtype (`maxsim_kept_in_float64`). vectors, masks: each
    column's B x tokens x d token vectors and B x tokens boolean masks, the anchors first; teacher:
    B x (1 + k)."""
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores
    from sentence_transformers.util import stack_padded_token_embeddings

    stacked, stacked_masks = stack_padded_token_embeddings(vectors[1:], masks[1:])
    with maxsim_kept_in_float64():
        scores = scale * colbert_scores(vectors[0], stacked, masks[0], stacked_masks)
    rows, group = torch.arange(len(stacked)), len(vectors) - 1
    student = scores.view(len(rows), len(rows), group)[rows, rows] / temperature
    target = torch.softmax(torch.as_tensor(teacher, dtype=student.dtype) / temperature, dim=1)
    assert target.shape == student.shape == (len(rows), group)
    return (target * (target.log() - torch.log_softmax(student, dim=1))).sum(dim=1)
