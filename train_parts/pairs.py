"""The data of train.py: training pairs read and checked, their batches, and the dev set. The seam to replace
with your own data pipeline: train.py uses these names and no others (the first line of `__all__`).

    load_pairs(source, columns, skip_bad_records, max_text_chars, say, teacher_scores) -> (datasets.Dataset,
        records skipped), from any --data form: a .jsonl, .json, .csv, .tsv or .parquet file (optionally
        .gz), a folder or glob of them, a save_to_disk folder, a hub data set. Columns: anchor, positive (a
        text or a list), negative_1..., [positive_scores, negative_scores].
    load_dev(source, columns, skip_bad_records, max_text_chars, say) -> the dev set: pairs, or a BEIR
        folder's (queries, corpus, relevant docs); build_evaluator(dev, num_queries, prompts, corpus_size,
        seed, say, sparse) -> its (Sparse)InformationRetrievalEvaluator.
    locate_data(source, flag) checks where a --data or --dev_data value points, before anything is read.
    make_loader(train_sets, BatchOrder(...), names) -> the training DataLoader (set_epoch orders each
        epoch); a batch is {column: texts}, with teacher_scores with a teacher's, with SOURCE_COLUMN with
        several sources.
    role_fields(columns, available) reads --columns; text_columns(names) gives the text columns, in order.

A problem with the data raises DataError, its message the place and what to do: train.py prints it as its
one-line failure. Flags served: --data, --columns, --dev_data, --dev_columns, --skip_bad_records,
--max_text_chars, --data_weights, --data_sampling (through BatchOrder). Nothing here imports accelerate or
reads train.py's flags.
"""

import collections
import csv
import dataclasses
import glob
import gzip
import hashlib
import itertools
import json
import math
import random
import re
import warnings
from pathlib import Path

import datasets
import huggingface_hub
import numpy
import pandas
import pyarrow as pa
import pyarrow.compute as pc
import torch
from sentence_transformers.multi_vector_encoder.evaluation import MultiVectorInformationRetrievalEvaluator
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.sparse_encoder.evaluation import SparseInformationRetrievalEvaluator

from .common import hub_out_of_reach, is_hub_name
from .records import DataError, ExampleWriter, cached_table, stamp

# fmt: off
__all__ = [
    "load_pairs", "load_dev", "build_evaluator", "locate_data", "make_loader", "BatchOrder", "role_fields",
    "text_columns", "DataError", "SOURCE_COLUMN",
    "load_beir", "SourceMix", "PositiveDraws",
]
# fmt: on


# ---------------------------------------------------------------------------------------------------------
# Records: pairs from a local file or a hub data set, every record checked before training (a bad one is
# named with its file and place, and what to do); each field read for its role as --columns or its name says
# ---------------------------------------------------------------------------------------------------------


def load_pairs(source, columns="", skip_bad_records=False, max_text_chars=20_000, say=print, flag="--data",
               teacher_scores=False):  # fmt: skip
    """(datasets.Dataset, records skipped) from `source`, any form locate_data reads; `columns` maps fields to
    roles as --columns does, `say` prints the mapping (the fields of all the records: each has a role or is
    unused), `flag` names the source. Columns: anchor, positive (a list stays a list: PositiveDraws picks one
    per epoch), negative_1..., with `teacher_scores` positive_scores, negative_scores. Each record is checked
    first: a bad one stops the run, named with its place, or with `skip_bad_records` is left out, counted.
    The checked records are converted once into a memory-mapped Arrow table (records.cached_table), read
    again only when the source or these options change."""
    kind, where, split = locate_data(source, flag)
    arrow = open_dataset(kind, where, split, source, flag) if kind in ("saved", "hub") else None
    if arrow is not None and not teacher_scores:  # Arrow on disk already: used where it lies if it passes
        if (in_place := arrow_in_place(arrow, source, columns, max_text_chars, say)) is not None:
            return in_place, 0
    found = stamp(where if kind == "files" else [where] if kind == "saved" else [])
    if kind == "hub":  # its cached copy's fingerprint: a new download, a new conversion
        found = [where, split, arrow._fingerprint]
    options = (columns, skip_bad_records, max_text_chars, teacher_scores)
    convert = lambda folder: convert_pairs(source, flag, options, say, folder)  # noqa: E731
    table, notes, fresh = cached_table(source, [found, split, flag, options], convert, flag)
    for line in notes["said"] if not fresh else ():  # what the conversion printed, said again
        say(line)
    return table, notes["skipped"]


def arrow_in_place(dataset, source, columns, max_chars, say):
    """A save_to_disk folder's table, or a hub data set's in datasets' cache, used where it lies
    (memory-mapped, no copy in our cache) when each mapped field is a column of texts and every text passes
    read_example's checks (Arrow counts them, column by column): its columns selected and renamed (anchor,
    positive, negative_1...). Else None: it is converted as any source, which names or skips the bad
    records and reads lists and teacher scores."""
    if not dataset.cache_files:  # held in memory: the conversion maps it from disk
        return None
    present = collections.Counter(dict.fromkeys(dataset.column_names, len(dataset)))
    fields, _ = mapped_fields(source, columns, present, False)
    names = [field for _, field in fields]
    if len(set(names)) < len(names):  # one field in two roles: the conversion copies it
        return None
    for field in names:
        texts = dataset.data.column(field)
        if not (pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type)):
            return None
        length, kept = pc.utf8_length(texts), pc.utf8_length(pc.utf8_trim_whitespace(texts))
        bad = pc.or_(pc.equal(kept, 0), pc.greater(length, max_chars)).fill_null(True)  # empty, long, none
        if pc.any(bad).as_py():
            return None
    where = Path(dataset.cache_files[0]["filename"]).parent
    say(f"train.py: {source}: {field_roles(fields, present)} (used in place: {where})")
    roles = ["anchor", "positive", *(f"negative_{k}" for k in range(1, len(names) - 1))]
    return dataset.select_columns(names).rename_columns(dict(zip(names, roles, strict=True)))


def convert_pairs(source, flag, options, say, folder):
    """Writes the checked examples of `source` into `folder` (records.ExampleWriter), streamed: a first pass
    over the records finds their fields, the second checks and writes each. Returns the notes: what it said,
    the records skipped (ExampleWriter.finish)."""
    columns, skip_bad_records, max_text_chars, teacher_scores = options
    examples = ExampleWriter(folder, teacher_scores, say)
    present = collections.Counter(
        field for _, r in read_records(source, flag) if isinstance(r, dict) for field in r
    )
    fields, scores = mapped_fields(source, columns, present, teacher_scores)
    examples.say(f"train.py: {source}: {field_roles(fields + scores, present)}")
    skipped, first_skipped = 0, None
    for place, record in read_records(source, flag):
        if isinstance(record, dict):  # else it says, in words, what is wrong with the record
            example = read_example(record, fields, max_text_chars, present)
            record = read_teacher_scores(record, example, scores) if teacher_scores else example
        if isinstance(record, dict):
            examples.add(record)
        elif skip_bad_records:
            skipped, first_skipped = skipped + 1, first_skipped or f"{place} {record}"
        else:  # skipping leaves out the bad records, not all
            todo = "Fix or delete it, or pass --skip_bad_records to leave it out" if present else NONE_READ
            raise DataError(f"{place} {record}. {todo}.")
    if skipped:
        examples.say(f"train.py: skipped {skipped} bad records; the first: {first_skipped}")
    if not examples.count:
        raise DataError(
            f"{source} holds no usable records." + (f" The first skipped: {first_skipped}" if skipped else "")
        )
    return examples.finish(source, skipped)


# The fields each role is read from when --columns does not name them: sentence-transformers' names, then
# FlagEmbedding's (query, pos, neg). Negatives: any field named (hard_)negative(s) or neg(s), numbered or not,
# or negative_text, _passage, _document, never negative_score, neg_ids...; a role added here is a column.
DEFAULT_FIELDS = {"anchor": ("anchor", "query"), "positive": ("positive", "pos")}
NEGATIVE_FIELD = re.compile(r"(hard_?)?(negative|neg)(s|_(text|passage|document))?(_?\d+)?", re.IGNORECASE)
MAP_YOURS = "Map yours with --columns, e.g. --columns anchor=question,positive=answer,negatives=neg1+neg2"
MAP_SCORES = "Map a teacher's scores with --columns pos_scores=s,neg_scores=s1+s2, or set --distill_weight 0"
NONE_READ = "No record can be read, so --skip_bad_records would leave none: fix the file"


def parse_columns(columns):
    """{role: fields} from --columns ('anchor=q,positive=a,negatives=n1+n2,pos_scores=s'), or DataError."""
    named = {}
    for item in filter(None, columns.split(",")):
        role, _, fields = (part.strip() for part in item.partition("="))
        if role not in (*DEFAULT_FIELDS, "negatives", *SCORE_FIELDS) or not (fields or role == "negatives"):
            raise DataError(
                f"--columns: cannot read {item!r}; write role=field with roles anchor, positive, negatives "
                "(several negatives joined by +, none as negatives=), pos_scores, neg_scores, e.g. "
                "anchor=question,positive=answer,negatives=neg1+neg2"
            )
        named[role] = fields
    return named


def role_fields(columns, available):
    """[(role, field)]: the anchor's, the positive's, then ("negative", field) for each negatives field, from
    --columns ('anchor=q,positive=a,negatives=n1+n2'; 'negatives=' for none) and the `available` fields."""
    named = parse_columns(columns)
    pairs = [
        (role, named.get(role) or next((field for field in names if field in available), names[0]))
        for role, names in DEFAULT_FIELDS.items()
    ]
    if "negatives" in named:
        negatives = [field for field in named["negatives"].split("+") if field]
    else:
        negatives = sorted(filter(NEGATIVE_FIELD.fullmatch, available), key=number_order)
    return pairs + [("negative", field) for field in negatives]


def number_order(name):
    """negative_2 before negative_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def field_roles(fields, present):
    """What each field is for: 'anchor <- query, positive <- pos, negatives <- neg; unused: id, score'."""
    roles = {role: [] for role in (*DEFAULT_FIELDS, "negatives")}
    for role, field in fields:
        roles.setdefault("negatives" if role == "negative" else role, []).append(field)
    used = ", ".join(f"{role} <- {' + '.join(names) or 'none'}" for role, names in roles.items())
    unused = ", ".join(field for field in present if field not in {field for _, field in fields}) or "none"
    return f"{used}; unused: {unused}"


# A teacher's scores (FlagEmbedding's fields): one per positive and one per negative, a number or a list.
SCORE_FIELDS = ("pos_scores", "neg_scores")
SCORE_COLUMNS = ("positive_scores", "negative_scores", "teacher_scores")
SOURCE_COLUMN = "source"  # a batch's --data source, with several
RESAMPLE_PASSES = 2  # new orders where repeated texts leave an epoch short, as sentence-transformers does


def mapped_fields(source, columns, present, teacher_scores):
    """(role_fields' [(role, field)], [(column, field)] of the teacher's scores: pos_scores, neg_scores with
    negatives or in records, or the fields --columns names), stopped where no record has a field."""
    fields, named = role_fields(columns, available=present), parse_columns(columns)
    negatives, scores = any(role == "negative" for role, _ in fields), []
    for column, field in zip(SCORE_COLUMNS[:2], SCORE_FIELDS, strict=True) if teacher_scores else ():
        names = named.get(field, field).split("+")
        scores += [(column, name) for name in names if field == "pos_scores" or negatives or name in present]
    absent = [f"{field!r} ({role})" for role, field in fields + scores if field not in present]
    if absent and present:  # with no field at all, no record could be read: the first is named below
        hint = MAP_SCORES if any(field not in present for _, field in scores) else MAP_YOURS
        raise DataError(
            f"{source} has no field {', '.join(absent)} in any record, only {sorted(present)}. {hint}"
        )
    return fields, scores


def read_teacher_scores(record, example, scores):
    """`example` with positive_scores and negative_scores from the record's `scores` fields (mapped_fields):
    one finite number per positive and per negative, in their order; or what is wrong, in words."""
    if not isinstance(example, dict):
        return example
    for column, field, texts in zip(SCORE_COLUMNS[:2], SCORE_FIELDS, ("positive", "negative"), strict=True):
        read = example[column] = []
        for name in (name for of, name in scores if of == column):
            if name not in record and example[texts]:
                return f"has no field {name!r} (teacher scores, for --distill_weight), only {sorted(record)}"
            value = record.get(name, [])
            for score in value if isinstance(value, list) else [value]:
                try:
                    read.append(float(score))
                except (TypeError, ValueError):
                    return f"has field {name!r} = {str(score)[:40]!r}, not a score (a number)"
                if not math.isfinite(read[-1]):
                    return f"has field {name!r} holding {score}, not a finite score"
        if len(read) != len(example[texts]):
            return f"has {len(read)} {field} for {len(example[texts])} {texts}s: give one score per text"
    return example


def text_columns(column_names):
    """The columns of texts, in order (anchor, positive, negatives), not the teacher scores or the source."""
    return [column for column in column_names if column not in (*SCORE_COLUMNS, SOURCE_COLUMN)]


def read_example(record, fields, max_chars, present):
    """{role: [texts]} from one record, or what is wrong with it in words: each mapped field holds a real text
    or, for a positive or negatives field, a non-empty list of them. `present`: records with each field."""
    example = {role: [] for role in (*DEFAULT_FIELDS, "negative")}
    for role, field in fields:
        if field not in record:
            return (
                f"has no field {field!r} ({role}) that {present[field]} other records have (it has "
                f"{sorted(record)}): every record needs each mapped field. {MAP_YOURS} (negatives= for none)"
            )
        value = record[field]
        listed = isinstance(value, list) and role != "anchor"
        if listed and not value:
            return f"has field {field!r} = an empty list, not a text"
        for i, text in enumerate(value if listed else [value]):
            if isinstance(text, str) and text and not text.isspace() and len(text) <= max_chars:
                continue  # a real text, the common case: checked in one test
            name = f"{field}[{i}]" if listed else field
            if text is None or (isinstance(text, str) and not text.strip()):
                return f"has field {name!r} empty"
            if not isinstance(text, str):
                return f"has field {name!r} = {type(text).__name__} {str(text)[:40]}, not a text (quote it)"
            if len(text) > max_chars:
                return f"has {len(text)} characters in field {name!r}, over --max_text_chars {max_chars}"
        example[role] += value if listed else [value]
    return example


def read_records(source, flag):
    """(place, record or what is wrong with it) for each record of `source`, the place naming its file: JSON
    read here, CSV and TSV by pandas, Parquet, save_to_disk folders and hub data sets by datasets."""
    kind, where, split = locate_data(source, flag)
    if kind == "beir":
        raise DataError(
            f"{flag} {source} is a BEIR folder (queries, corpus, qrels): evaluate on it with --dev_data."
        )
    if kind == "files":
        return itertools.chain.from_iterable(file_records(path) for path in where)
    dataset = open_dataset(kind, where, split, source, flag)
    return ((f"{source}, record {i}", record) for i, record in enumerate(dataset, 1))


def open_dataset(kind, where, split, source, flag):
    """The datasets.Dataset of a save_to_disk folder ("saved") or a hub data set ("hub"), its split picked."""
    saved = kind == "saved"
    try:
        dataset = datasets.load_from_disk(str(where)) if saved else datasets.load_dataset(where, split=split)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[one_split(dataset, split, source, flag)]
    except Exception as err:
        what = "a save_to_disk folder" if saved else "a hub data set (needs network or a cached copy)"
        raise DataError(f"{flag} {source} could not be read as {what} ({type(err).__name__}: {err})") from err
    return dataset


# The data files read, by suffix (then optionally .gz); a folder or glob of them is read file after file.
DATA_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
FORMAT_NAMES = ", ".join(DATA_FORMATS).replace(", .parquet", " or .parquet")


def data_format(path):
    suffixes = [suffix for suffix in Path(path).suffixes if suffix != ".gz"]
    return DATA_FORMATS.get(suffixes[-1].lower()) if suffixes else None


def locate_data(source, flag):
    """(kind, where, split) of a --data or --dev_data value; one naming nothing stops at once, in one line.
    kind "files": `where` lists the data files (one file, a glob such as shards/*.jsonl, or a folder, read as
    datasets splits its files: train-*.parquet...); "saved": a save_to_disk folder; "beir": a BEIR folder;
    "hub": a hub data set name. A split follows a folder or hub name after a colon: name:split."""
    name, split = source, None
    if ":" in source and not Path(source).exists():
        name, _, split = source.rpartition(":")
    path = Path(name).expanduser()
    if any(char in source for char in "*?["):
        files = sorted(Path(match) for match in glob.glob(str(path), recursive=True) if Path(match).is_file())
        if not files:
            raise DataError(f"{flag}: no such file or folder: {source} (no file matches the pattern).")
    elif path.is_file():
        files = [path]
    elif path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "saved", path, split
        if (path / "corpus.jsonl").is_file() and (path / "queries.jsonl").is_file():
            return "beir", path, split
        try:
            splits = datasets.data_files.DataFilesDict.from_patterns(
                datasets.data_files.get_data_patterns(str(path)), base_path=str(path)
            )
        except datasets.data_files.EmptyDatasetError:
            splits = {}
        files = [Path(file) for file in splits[one_split(splits, split, source, flag)]] if splits else []
        files = [file for file in files if data_format(file)]
        if not files:
            raise DataError(f"{flag} {source}: a folder without {FORMAT_NAMES} files.")
    elif data_format(name) is None and is_hub_name(name):
        if (offline := hub_out_of_reach()) and not huggingface_hub.constants.is_offline_mode():
            raise DataError(
                f"{flag}: no such file or folder: {source}, and the hub is out of reach ({offline}). "
                "With HF_HUB_OFFLINE=1 a cached copy of a hub data set loads; else pass a local file."
            )
        return "hub", name, split
    else:
        raise DataError(
            f"{flag}: no such file or folder: {source}. Check the path (a relative one starts at the launch)."
        )
    formats = {data_format(file) for file in files}
    if len(formats) > 1 or None in formats:
        kinds = ", ".join(sorted({"".join(file.suffixes) or file.name for file in files}))
        raise DataError(
            f"{flag} {source} holds {kinds}: give files of one format, {FORMAT_NAMES} (optionally .gz)."
        )
    return "files", files, None


# The split read when none is given (name:split), then the only one: train to train on, dev to evaluate on.
DEFAULT_SPLITS = {"--data": ("train",), "--dev_data": ("dev", "validation", "test")}


def one_split(splits, split, source, flag):
    """The split asked for, else the flag's default, else the only one; else stop, listing them."""
    split = split or next((name for name in DEFAULT_SPLITS[flag] if name in splits), None)
    if split is None and len(splits) == 1:
        return next(iter(splits))
    if split not in splits:
        raise DataError(
            f"{flag} {source} has the splits {', '.join(map(str, splits))}: pick one, as {source}:<split>."
        )
    return split


def file_records(path):
    """(place, record or what is wrong with it) for each record of one data file."""
    form = data_format(path)
    if form == "json":
        array = json_array(path) if ".json" in path.suffixes else None
        return json_lines(path) if array is None else array
    try:
        if form == "parquet":
            rows = datasets.load_dataset("parquet", data_files=str(path), split="train")
        else:  # every field as written: pandas guessed "007" 7, "1e3" 1000, "NA" missing; TSV is never quoted
            tsv = {"sep": "\t", "quoting": csv.QUOTE_NONE} if form == "tsv" else {}
            rows = pandas.read_csv(path, dtype=str, keep_default_na=False, **tsv).to_dict("records")
    except Exception as err:
        raise DataError(
            f"{path} could not be read as a {form} file ({type(err).__name__}: {err}). Check or convert it."
        ) from err
    return ((f"{path}, record {i}", record) for i, record in enumerate(rows, 1))


def json_array(path):
    """(place, record or what is wrong with it) for a .json[.gz] file holding one JSON array of records,
    "record N"; None for a file of JSON lines. A file holding another JSON value over several lines stops."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as file:
        content = file.read()
    text = content.decode("utf-8", errors="replace")  # strictly decoded below, or by json_lines line by line
    if text.lstrip().startswith("["):
        try:
            values = json.loads(content.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path} is not valid UTF-8 (byte {content[err.start]:#04x} at offset {err.start}). "
                "Save it as UTF-8."
            ) from None
        except json.JSONDecodeError as err:
            raise DataError(
                f"{path} is not valid JSON (line {err.lineno}, {json_error(err)}). {JSON_FORMS}"
            ) from None
        return [(f"{path}, record {i}", json_record(value)) for i, value in enumerate(values, 1)]
    if sum(1 for line in text.splitlines() if line.strip()) > 1:
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:  # several values (JSON lines), or a bad line that json_lines names
            return None
        raise DataError(
            f"{path} holds one JSON {type(whole).__name__} over several lines, not records. {JSON_FORMS}"
        )
    return None


def json_lines(path):
    """(place, record or what is wrong with it) for every non-blank line of a JSON lines file, "line N"."""
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                text = raw.decode("utf-8")
                record = json_record(json.loads(text)) if text.strip() else None  # a blank line: none
            except UnicodeDecodeError as err:
                record = f"is not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
            except json.JSONDecodeError as err:
                if err.lineno > 1:  # past the line's end (truncated): at its end, not line 2 column 1
                    err = json.JSONDecodeError(err.msg, text.rstrip("\r\n"), len(text.rstrip("\r\n")))
                record = f"is not valid JSON ({json_error(err)})"
            if record is not None:
                yield f"{path}, line {number}", record


def json_record(value):
    if isinstance(value, dict):
        return value
    return f"is a JSON {type(value).__name__}, not an object with named fields"


# What a .json file holds; the likely causes of json errors that do not say them ("Invalid control ... at")
JSON_FORMS = (
    'Write a JSON array of records, [{"anchor": ..., "positive": ...}, ...], or JSON lines, one record '
    "per line."
)
JSON_CAUSES = {
    "Invalid control character": "a raw tab or newline inside a string: write \\t or \\n",
    "Invalid \\": "a backslash that starts no escape: write \\\\ for one",
    "Extra data": "more after the record: one record a line",
}


def json_error(err):
    """'column 323: invalid control character, a raw tab or newline inside a string: write \\t or \\n'."""
    what = err.msg.removesuffix(" at").removesuffix(" starting")
    cause = next((f", {cause}" for start, cause in JSON_CAUSES.items() if what.startswith(start)), "")
    return f"column {err.colno}: {what[0].lower()}{what[1:]}{cause}"


# ---------------------------------------------------------------------------------------------------------
# Batches: no text twice in a batch, one source per optimizer step, an order that a resume replays
# ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchOrder:
    """What orders the batches (train.py fills it from its flags): `processes` batches in a row are dealt
    out to the processes by accelerate; with `cross_process_negatives` they are contrasted together."""

    batch_size: int
    seed: int = 42
    processes: int = 1
    cross_process_negatives: bool = False
    gradient_accumulation_steps: int = 1
    data_weights: tuple | None = None  # several sources: each step's source drawn with these odds
    data_sampling: str = "proportional"  # or round_robin

    @property
    def group(self):  # the batches contrasted together
        return self.processes if self.cross_process_negatives else 1


def make_loader(train_sets, order, names=None):
    """The training batches of the sources' pairs (`names` name them in errors), which accelerate shards over
    the processes; set_epoch orders each epoch. With several sources, one an optimizer step (SourceMix)."""
    if len(train_sets) == 1:
        sampler = NoDuplicatesOrder(train_sets[0], order.batch_size, order.seed, order.group)
    else:
        sampler = SourceMix(train_sets, order, names or [f"source {k}" for k in range(len(train_sets))])
    # Its own generator: by default every new iterator draws a seed from the global RNG, so a resumed run
    # (one iterator more) would draw other dropout masks than an uninterrupted one.
    return torch.utils.data.DataLoader(
        sampler.examples, order.batch_size, sampler=sampler, drop_last=True, generator=torch.Generator()
    )


class NoDuplicatesOrder(torch.utils.data.Sampler):
    """Indices in batches that hold no text twice, across columns (a duplicate is a false negative): the
    rule of sentence-transformers' NoDuplicatesBatchSampler (a text that repeats one in the batch waits for a
    later batch, and leads it), streamed, so that an epoch holds a batch and the texts waiting, never an
    index per example: the shuffle is a keyed permutation (`shuffled`) computed block by block, the texts are
    compared by their 64-bit hashes. Seeded by seed + epoch, so a resume replays it.
    A flat sampler, not a batch sampler: the DataLoader then keeps a `batch_size`, which accelerate needs to
    shard batches over processes and to fill DeepSpeed's "auto" micro-batch size. `group` batches in a row
    hold no text twice together: with cross-process negatives a step contrasts the batches of all processes,
    which accelerate deals out as consecutive batches (process i takes batches i, i + P, ...)."""

    def __init__(self, dataset, batch_size, seed, group=1):
        self.examples = PositiveDraws(dataset, seed)  # what the DataLoader reads: one positive per example
        self.batch_size, self.seed, self.epoch = batch_size * group, seed, 0

    def set_epoch(self, epoch):  # called by accelerate's DataLoaderShard.set_epoch
        self.examples.epoch = self.epoch = epoch

    def __iter__(self):
        return self.indices(self.epoch)

    def __len__(self):
        return len(self.examples) // self.batch_size * self.batch_size

    def indices(self, epoch):
        """The indices of `epoch`'s batches, one after the other. As sentence-transformers' sampler does,
        passes in new orders follow where data with many repeated texts fill fewer batches than __len__
        promises the scheduler (and then warn)."""
        wanted, made = len(self) // self.batch_size, 0
        for extra_pass in range(1 + RESAMPLE_PASSES if wanted else 0):
            if extra_pass == 1:
                warnings.warn(
                    f"{made} batches of {self.batch_size} examples without a text twice fill only part of an "
                    f"epoch of {wanted}: the rest repeat examples. Lower --batch_size, or remove repeated "
                    "texts.",
                    stacklevel=2,
                )
            for batch in self.one_pass(epoch, extra_pass):
                yield from batch
                made += 1
                if made == wanted:
                    return

    def one_pass(self, epoch, extra_pass):
        """One shuffle's full batches. `waiting` holds the examples passed over (a text of theirs was in the
        batch), in the shuffle's order: each batch tries them first, then the examples not yet seen."""
        order = shuffled(len(self.examples), f"{self.seed}:{epoch}:{extra_pass}")
        waiting, upcoming = [], self.hashed(epoch, order)
        while True:
            batch, taken, still_waiting = [], set(), []
            for example in waiting:
                if len(batch) < self.batch_size and taken.isdisjoint(example[1]):
                    batch.append(example[0])
                    taken.update(example[1])
                else:
                    still_waiting.append(example)
            waiting = still_waiting
            for example in upcoming if len(batch) < self.batch_size else ():
                if taken.isdisjoint(example[1]):
                    batch.append(example[0])
                    taken.update(example[1])
                    if len(batch) == self.batch_size:
                        break
                else:
                    waiting.append(example)
            if len(batch) == self.batch_size:
                yield batch
            elif not waiting:  # every example seen: the last, part batch is dropped
                return

    def hashed(self, epoch, indices):
        """(index, hashes of its texts) for `indices`: the texts of a block of examples read at once."""
        for block in map(numpy.ndarray.tolist, indices):
            rows = self.examples.texts(block, epoch)
            hashes = pandas.util.hash_array(numpy.array(rows, dtype=object).ravel())  # alike in every process
            yield from zip(block, map(frozenset, hashes.reshape(len(rows), -1).tolist()), strict=True)


def shuffled(size, key, block=1024):
    """0 .. size - 1 in the order of a permutation keyed by `key` (a text), in numpy blocks of at most
    `block`: a 4-round Feistel network over the smallest even power of two >= size, its outputs >= size left
    out. No memory per index, unlike torch.randperm; the same key, the same order in every process and run."""
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = numpy.uint64((1 << half) - 1)
    round_keys = [int.from_bytes(hashlib.blake2b(f"{key}:{r}".encode(), digest_size=8).digest(), "little")
                  for r in range(4)]  # fmt: skip
    for start in range(0, 1 << (2 * half), block):
        positions = numpy.arange(start, min(start + block, 1 << (2 * half)), dtype=numpy.uint64)
        left, right = positions >> numpy.uint64(half), positions & mask
        for round_key in round_keys:
            left, right = right, left ^ (mixed(right ^ numpy.uint64(round_key)) & mask)
        values = (left << numpy.uint64(half)) | right
        values = values[values < size]
        if len(values):
            yield values.astype(numpy.int64)


def mixed(x):
    """splitmix64's finalizer (Steele, Lea, Flood 2014) on uint64 arrays: the Feistel rounds' function."""
    x = (x ^ (x >> numpy.uint64(30))) * numpy.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> numpy.uint64(27))) * numpy.uint64(0x94D049BB133111EB)
    return x ^ (x >> numpy.uint64(31))


class SourceMix(torch.utils.data.Sampler):
    """Several --data sources: every optimizer step takes all its batches, on every process, from one source,
    so that its in-batch negatives come from one task and all processes compute one loss.

    Each source is read in its own NoDuplicatesOrder, cut into steps of batch_size x processes x
    gradient_accumulation_steps examples (a last part step left out). The sources of epoch e's steps are
    drawn from (seed, e): by default every step of every source once, shuffled; with --data_weights as many
    steps, each source drawn with those odds; round_robin, the sources in turn until the largest is read. A
    source used up starts its next pass in a new order. The indices name (source, pass, example): the order
    is a function of the seed and the epoch alone, so set_epoch, and a resume, replay it."""

    def __init__(self, train_sets, order, names):
        self.orders = [  # each source's own seed: two copies of a file are not read in step
            NoDuplicatesOrder(data, order.batch_size, order.seed + k, order.group)
            for k, data in enumerate(train_sets)
        ]
        self.examples = SourceExamples([source.examples for source in self.orders])
        self.step_size = order.batch_size * order.processes * order.gradient_accumulation_steps
        self.steps = [len(source) // self.step_size for source in self.orders]  # in one pass of each source
        for name, source, steps in zip(names, self.orders, self.steps, strict=True):
            if steps == 0:
                raise DataError(
                    f"{name} makes no optimizer step: one takes {self.step_size} examples (--batch_size x "
                    f"{order.processes} processes x --gradient_accumulation_steps), no text twice in a "
                    f"batch, and it gives {len(source)}. Lower --batch_size, or leave the source out."
                )
        self.seed, self.weights, self.sampling = order.seed, order.data_weights, order.data_sampling
        self.epoch, self.steps_per_epoch = 0, len(self.schedule(0))  # the same every epoch

    def schedule(self, epoch):
        """The source of each optimizer step of `epoch`."""
        sources = range(len(self.steps))
        if self.sampling == "round_robin":
            return [step % len(sources) for step in range(len(sources) * max(self.steps))]
        draw = random.Random(f"{self.seed}:{epoch}")
        if self.weights:
            return draw.choices(sources, self.weights, k=sum(self.steps))
        schedule = [source for source in sources for _ in range(self.steps[source])]
        draw.shuffle(schedule)
        return schedule

    def set_epoch(self, epoch):  # called by accelerate's DataLoaderShard.set_epoch
        self.epoch = epoch

    def __iter__(self):
        used = collections.Counter(source for epoch in range(self.epoch) for source in self.schedule(epoch))
        reading = {}  # source: (its pass, the indices of the pass still to come)
        for source in self.schedule(self.epoch):
            source_pass, step = divmod(used[source], self.steps[source])
            used[source] += 1
            if reading.get(source, (None,))[0] != source_pass:  # begun in an earlier epoch: skip its head
                indices = self.orders[source].indices(source_pass)
                reading[source] = source_pass, itertools.islice(indices, step * self.step_size, None)
            indices = itertools.islice(reading[source][1], self.step_size)
            yield from ((source, source_pass, index) for index in indices)

    def __len__(self):  # asked often by the DataLoader and accelerate: no new schedule each time
        return self.steps_per_epoch * self.step_size


class SourceExamples(torch.utils.data.Dataset):
    """The examples of several sources (their PositiveDraws) by SourceMix's (source, pass, example), each
    with its source's number: the step reads it to use that source's flags."""

    def __init__(self, sources):
        self.sources = sources

    def __len__(self):
        return sum(map(len, self.sources))

    def __getitem__(self, index):
        source, source_pass, example = index
        return self.sources[source].draw(example, source_pass) | {SOURCE_COLUMN: source}


class PositiveDraws(torch.utils.data.Dataset):
    """The examples, each with one of its positives when it has a list of them: drawn anew each epoch from
    (seed, epoch, example), so a resumed run draws what the uninterrupted one drew. With a teacher's scores,
    the drawn positive's and the negatives' become `teacher_scores`. `texts` reads many examples' texts at
    once, for the batch order."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, 0
        self.column_names = dataset.column_names
        self.text_data = dataset.select_columns(text_columns(self.column_names))

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.draw(index, self.epoch)

    def draw(self, index, epoch):
        example, drawn = self.dataset[index], 0
        if isinstance(example["positive"], list):
            drawn = self.drawn(index, epoch, len(example["positive"]))
            example["positive"] = example["positive"][drawn]
        if "positive_scores" in example:
            scores = example.pop("positive_scores")[drawn], *example.pop("negative_scores")
            example["teacher_scores"] = list(scores)
        return example

    def drawn(self, index, epoch, count):
        return random.Random(f"{self.seed}:{epoch}:{index}").randrange(count)  # what random.choice draws

    def texts(self, indices, epoch):
        """The texts of the examples `indices` (the drawn positive of each), a tuple an example."""
        columns = self.text_data[indices]
        columns["positive"] = [
            texts[self.drawn(index, epoch, len(texts))] if isinstance(texts, list) else texts
            for index, texts in zip(indices, columns["positive"], strict=True)
        ]
        return list(zip(*columns.values(), strict=True))


# ---------------------------------------------------------------------------------------------------------
# The dev evaluator: retrieval on pairs (their distinct positives the corpus) or on a BEIR folder
# ---------------------------------------------------------------------------------------------------------


def load_dev(source, columns="", skip_bad_records=False, max_text_chars=20_000, say=print):
    """The dev set of --dev_data: a BEIR folder's (queries, corpus, relevant docs), or pairs as load_pairs
    reads them (`columns`: --dev_columns)."""
    kind, where, split = locate_data(source, "--dev_data")
    if kind == "beir":
        return load_beir(where, split, say)
    return load_pairs(source, columns, skip_bad_records, max_text_chars, say, flag="--dev_data")[0]


def load_beir(folder, split, say=print):
    """(queries, corpus, relevant docs) of a BEIR folder: corpus.jsonl (_id, title, text), queries.jsonl
    (_id, text), qrels/<split>.tsv (query-id, corpus-id, score; that header), split dev, else test. Relevant:
    a score above 0. A document: its title and text, as BEIR's models encode it; queries: those with one."""
    splits = {path.stem: path for path in sorted((folder / "qrels").glob("*.tsv"))}
    if not splits:
        raise DataError(
            f"--dev_data {folder}: a BEIR folder needs qrels/<split>.tsv (query-id, corpus-id, score)."
        )
    qrels_path = splits[one_split(splits, split, str(folder), "--dev_data")]
    qrels = pandas.read_csv(qrels_path, sep="\t", dtype=str, keep_default_na=False)
    if list(qrels.columns[:3]) != ["query-id", "corpus-id", "score"]:
        raise DataError(
            f"{qrels_path} starts with {list(qrels.columns)}: a BEIR qrels file is tab-separated, with the "
            "header query-id, corpus-id, score."
        )
    scores = pandas.to_numeric(qrels["score"], errors="coerce")
    if scores.isna().any():
        row = scores.isna().idxmax()
        raise DataError(f"{qrels_path}, row {row + 1}: score {qrels['score'][row]!r} is not a number.")
    relevant = collections.defaultdict(set)
    for query_id, corpus_id in qrels.loc[scores > 0, ["query-id", "corpus-id"]].itertuples(index=False):
        relevant[query_id].add(corpus_id)

    def texts(name):
        by_id = {}
        for place, record in json_lines(folder / name):
            if not (isinstance(record, dict) and "_id" in record and isinstance(record.get("text"), str)):
                raise DataError(
                    f"{place} {record if isinstance(record, str) else 'needs an _id and a text'} (BEIR)."
                )
            by_id[str(record["_id"])] = f"{record.get('title') or ''} {record['text']}".strip()
        return by_id

    corpus, queries = texts("corpus.jsonl"), texts("queries.jsonl")
    queries = {query_id: text for query_id, text in queries.items() if relevant.get(query_id)}
    if not queries:
        raise DataError(f"{qrels_path}: no query of queries.jsonl has a document scored above 0.")
    say(
        f"train.py: {folder}: BEIR split {qrels_path.stem}, {len(queries)} queries with relevant documents, "
        f"a corpus of {len(corpus)} documents"
    )
    return queries, corpus, {query_id: relevant[query_id] for query_id in queries}


def build_evaluator(dev, num_queries, prompts=None, corpus_size=0, seed=42, say=print, kind="dense"):
    """Retrieve each query's relevant documents among the corpus, scored by sentence-transformers' evaluator
    of the model's `kind` (EVALUATORS), for the first `num_queries` queries (0: all) of `dev`: pairs
    (pairs_retrieval) or load_beir's. The corpus: all, or `corpus_size` N: relevant documents, N drawn."""
    queries, corpus, relevant_docs = dev if isinstance(dev, tuple) else pairs_retrieval(dev)
    kept, prompts = list(queries)[: num_queries or None], prompts or {}
    relevant = set().union(*(relevant_docs[query_id] for query_id in kept)) & corpus.keys()
    others, whole = [doc for doc in corpus if doc not in relevant] if corpus_size else [], len(corpus)
    drawn = set(random.Random(seed).sample(others, corpus_size)) if 0 < corpus_size < len(others) else set()
    if drawn:  # kept in the corpus's order: the same documents on every process
        corpus = {doc_id: text for doc_id, text in corpus.items() if doc_id in relevant or doc_id in drawn}
    part = f"{len(relevant)} relevant + {len(drawn)} drawn" if drawn else "all"
    say(f"train.py: dev set: {len(kept)} queries against {len(corpus)} documents ({part} of {whole})")
    return EVALUATORS[kind](
        queries={query_id: queries[query_id] for query_id in kept}, corpus=corpus,
        relevant_docs={query_id: relevant_docs[query_id] for query_id in kept}, mrr_at_k=[10], ndcg_at_k=[10],
        accuracy_at_k=[1, 10], precision_recall_at_k=[1, 10], map_at_k=[10], batch_size=128, name="dev",
        write_csv=False,
        # "" for none: given None, the evaluator falls back to the model's prompt, which training leaves out
        query_prompt=prompts.get("query") or "", corpus_prompt=prompts.get("document") or "",
    )  # fmt: skip


EVALUATORS = {
    "dense": InformationRetrievalEvaluator,
    "sparse": SparseInformationRetrievalEvaluator,  # it counts the active dimensions too
    "multi-vector": MultiVectorInformationRetrievalEvaluator,  # MaxSim over token matrices
}


def pairs_retrieval(dev):
    """(queries, corpus, relevant docs) of pairs: the anchors, the distinct positives, each anchor's own."""
    positives = [texts if isinstance(texts, list) else [texts] for texts in dev["positive"]]
    corpus_ids = {text: f"d{i}" for i, text in enumerate(dict.fromkeys(itertools.chain(*positives)))}
    queries = {f"q{i}": text for i, text in enumerate(dev["anchor"])}
    relevant = {f"q{i}": {corpus_ids[text] for text in texts} for i, texts in enumerate(positives)}
    return queries, {cid: text for text, cid in corpus_ids.items()}, relevant
