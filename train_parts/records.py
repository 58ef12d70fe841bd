"""Checked records kept on disk: the examples of a --data or --dev_data source written once into an Arrow
table that every process memory-maps (the pages are the OS's, shared by the processes of a node), reused by
later runs and resumes until the source changes.

Also kept there: each anchor's known positives (positives_by_anchor), searched once per table.

Flags served: --data, --dev_data (through pairs.load_pairs), --mask_repeated_texts (positives_by_anchor);
the cache folder moves with the environment variable GRADCACHE_DATA_CACHE (default: datasets' cache,
HF_DATASETS_CACHE, in gradcache_pairs/).
"""

import collections
import glob
import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import datasets
import numpy
import pandas
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["DataError", "CACHE_VARIABLE", "cache_root", "stamp", "cached_table", "ExampleWriter"]
__all__ += ["positives_by_anchor", "text_id"]

CACHE_VARIABLE = "GRADCACHE_DATA_CACHE"
FORMAT = 1  # raised when the table's layout changes: older conversions are then not reused
ROWS_A_BATCH = 10_000  # examples held in memory while converting
ENDS = 1 << 16  # bytes read at each end of a source file for its stamp


class DataError(ValueError):
    """The data cannot be used as given: the message names the place and what to do, in one line."""


def cache_root():
    """Where conversions are kept: $GRADCACHE_DATA_CACHE, else gradcache_pairs/ in datasets' cache."""
    return Path(os.environ.get(CACHE_VARIABLE) or Path(datasets.config.HF_DATASETS_CACHE) / "gradcache_pairs")


def stamp(paths):
    """[path, size, modification time, hash of its ends] of each file of `paths` (a folder: every file in
    it): a source that changes on disk gets another conversion. The ends' hash catches a rewrite of the same
    size within the clock's tick, which leaves the modification time as it was."""
    files = []
    for path in map(Path, paths):
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file():
                status = file.stat()
                with open(file, "rb") as content:
                    ends = content.read(ENDS)
                    content.seek(max(len(ends), status.st_size - ENDS))
                    ends += content.read(ENDS)
                ends = hashlib.blake2b(ends, digest_size=16).hexdigest()
                files.append([str(file.resolve()), status.st_size, status.st_mtime_ns, ends])
    return files


def cached_table(name, key, convert, flag):
    """(datasets.Dataset memory-mapped from the cache, the notes `convert` returned, whether it converted).
    `key` (JSON: the source's stamp and the reading options) names the conversion; `convert(folder)` writes
    data.arrow into a fresh folder and returns notes (JSON). A conversion is written in a folder of its own,
    then renamed into place: two processes converting at once leave one whole copy, never a mix."""
    root = cache_root()
    digest = hashlib.blake2b(json.dumps([FORMAT, key]).encode(), digest_size=16).hexdigest()
    folder = root / f"{Path(name).name[:40]}-{digest}"
    fresh = not (folder / "notes.json").is_file()
    if fresh:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_abandoned_parts(root, folder.name)
            owner = f"{socket.gethostname()}-{os.getpid()}"
            part = Path(tempfile.mkdtemp(prefix=f"{folder.name}.part-{owner}-", dir=root))
        except OSError as err:
            raise DataError(
                f"{flag} {name}: cannot write the data cache in {root} ({err.strerror or err}). Set "
                f"{CACHE_VARIABLE} to a writable folder."
            ) from None
        try:
            notes = convert(part)
            (part / "notes.json").write_text(json.dumps(notes))  # written last: the conversion is whole
            part.rename(folder)
        except OSError:  # another process renamed its copy first: use that one
            if not (folder / "notes.json").is_file():
                raise
        finally:
            shutil.rmtree(part, ignore_errors=True)
    notes = json.loads((folder / "notes.json").read_text())
    return datasets.Dataset.from_file(str(folder / "data.arrow")), notes, fresh


def remove_abandoned_parts(root, name):
    """Removes the conversions of `name` left half-written by a process of this machine that is gone (killed
    by the scheduler, out of memory): their folders name their host and process (<name>.part-<host>-<pid>-).
    Parts of other machines sharing the folder are left to them."""
    host = socket.gethostname()
    for part in root.glob(f"{glob.escape(name)}.part-*"):
        owner_host, _, rest = part.name[len(name) + len(".part-") :].rpartition("-")[0].rpartition("-")
        pid = rest if owner_host == host else ""
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(part, ignore_errors=True)


def process_alive(pid):
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class ExampleWriter:
    """The checked examples ({role: [texts]}, with a teacher's scores {column: [numbers]}) written to disk a
    batch at a time; `finish` gives them the columns of a table: anchor, positive (a list where any example
    has several), negative_1... as many as the example with fewest has, [positive_scores, negative_scores]."""

    def __init__(self, folder, teacher_scores, say=print):
        texts, scores = pa.list_(pa.string()), pa.list_(pa.float64())
        fields = [("anchor", pa.string()), ("positive", texts), ("negative", texts)]
        fields += [("positive_scores", scores), ("negative_scores", scores)] if teacher_scores else []
        self.schema, self.folder = pa.schema(fields), Path(folder)
        self.columns_read = {name: [] for name in self.schema.names}
        self.raw = pa.ipc.new_stream(str(self.folder / "examples.arrow"), self.schema)
        self.count, self.fewest, self.most, self.several_positives = 0, None, 0, False
        self.said, self.print = [], say

    def say(self, line):  # printed now, kept in the notes to be said again when the conversion is reused
        self.said.append(line)
        self.print(line)

    def add(self, example):
        negatives = len(example["negative"])
        self.fewest, self.most = (
            min(self.fewest if self.count else negatives, negatives),
            max(self.most, negatives),
        )
        self.several_positives |= len(example["positive"]) > 1
        self.count += 1
        for name, column in self.columns_read.items():  # a column a field: faster than rows to Arrow
            column.append(example[name])
        if len(self.columns_read["anchor"]) == ROWS_A_BATCH:
            self.flush()

    def flush(self):
        if self.columns_read["anchor"]:
            self.columns_read["anchor"] = [texts[0] for texts in self.columns_read["anchor"]]
            arrays = [pa.array(self.columns_read[field.name], field.type) for field in self.schema]
            self.raw.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
            self.columns_read = {name: [] for name in self.schema.names}

    def finish(self, source, skipped):
        """Writes data.arrow, the table's columns, from the examples, one batch at a time (Arrow alone);
        returns the notes of the conversion: what it said, the records `skipped`."""
        if self.fewest < self.most:  # a batch needs as many negatives in every row: cut to the fewest
            self.say(
                f"train.py: {source}: records hold {self.fewest} to {self.most} negatives; each uses "
                f"its first {self.fewest} (every row of a batch needs as many). Drop the short records to "
                "keep more."
            )
        self.flush()
        self.raw.close()
        raw = self.folder / "examples.arrow"
        with pa.memory_map(str(raw)) as source, pa.ipc.open_stream(source) as batches:
            writer = None
            for batch in batches:
                table = self.columns(batch)
                writer = writer or pa.ipc.new_stream(str(self.folder / "data.arrow"), table.schema)
                writer.write_table(table)
            writer.close()
        raw.unlink()
        return {"said": self.said, "skipped": skipped}

    def columns(self, batch):
        positive = batch["positive"]
        columns = {
            "anchor": batch["anchor"],
            "positive": positive if self.several_positives else pc.list_element(positive, 0),
        }
        columns |= {f"negative_{i + 1}": pc.list_element(batch["negative"], i) for i in range(self.fewest)}
        if "positive_scores" in batch.schema.names:
            columns["positive_scores"] = batch["positive_scores"]
            columns["negative_scores"] = pc.list_slice(
                batch["negative_scores"], 0, self.fewest, return_fixed_size_list=False
            )
        return pa.table(columns)


# ---------------------------------------------------------------------------------------------------------
# Known positives: an anchor's other positives in the data are right answers, never its negatives
# ---------------------------------------------------------------------------------------------------------
def positives_by_anchor(*train_sets):
    """{anchor id: ids of its positives} for the anchors with several positives in the data (a list, or
    several records, of any source): every one of them is a right answer of the anchor, never one of its
    negatives. Tables read from files (the data cache, a save_to_disk folder) keep the answer in the data
    cache (cache_root()/known_positives/), keyed by the files' stamps and the tables' fingerprints (which
    follow --max_train_examples' selection): later runs and resumes read it instead of every anchor."""
    if not all(getattr(data, "cache_files", None) for data in train_sets):  # in memory: nothing to key by
        return find_positives_by_anchor(train_sets)
    key = [
        stamp(file["filename"] for data in train_sets for file in data.cache_files),
        [[data._fingerprint, len(data)] for data in train_sets],
    ]
    digest = hashlib.blake2b(json.dumps(key).encode(), digest_size=16).hexdigest()
    path = cache_root() / "known_positives" / f"{digest}.json"
    if path.is_file():
        return {int(anchor): ids for anchor, ids in json.loads(path.read_text()).items()}
    known = find_positives_by_anchor(train_sets)
    try:  # written whole, then renamed into place: a reader never sees a part
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.part-{os.getpid()}")
        part.write_text(json.dumps(known))
        part.replace(path)
    except OSError:  # a cache that cannot be written costs the next run this search again, nothing else
        pass
    return known


def find_positives_by_anchor(train_sets):
    """positives_by_anchor, read in Arrow batches: a vectorized hash of every anchor (4 bytes a record, the
    high half of a 64-bit hash) finds the anchors of several records or positives, and only their rows are
    read as texts, for their text ids. A collision of the halves costs reading one row more, nothing else."""
    batches = [batch for data in train_sets for batch in arrow_batches(data)]  # memory-mapped: no copies
    quick = numpy.concatenate(
        [
            (pandas.util.hash_array(a.to_numpy(zero_copy_only=False)) >> 32).astype(numpy.uint32)
            for a, _ in batches
        ]
    )
    ordered = numpy.sort(quick)
    repeated = numpy.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    del ordered
    several, start = collections.defaultdict(set), 0
    for anchors, positives in batches:
        hashes, start = quick[start : start + len(anchors)], start + len(anchors)
        chosen = numpy.isin(hashes, repeated)
        if pa.types.is_list(positives.type):
            chosen |= pc.list_value_length(positives).to_numpy(zero_copy_only=False) > 1
        for anchor, texts in zip(
            anchors.filter(chosen).to_pylist(), positives.filter(chosen).to_pylist(), strict=True
        ):
            several[text_id(anchor)].update(map(text_id, texts if isinstance(texts, list) else [texts]))
    return {anchor: sorted(ids) for anchor, ids in several.items() if len(ids) > 1}


def arrow_batches(data):
    """(anchors, positives) as Arrow arrays, 10,000 records at a time, of a datasets.Dataset or of columns as
    lists."""
    if not hasattr(data, "with_format"):
        positives = [texts if isinstance(texts, list) else [texts] for texts in data["positive"]]
        yield pa.array(data["anchor"]), pa.array(positives)
        return
    for batch in data.select_columns(["anchor", "positive"]).with_format("arrow").iter(10_000):
        yield batch["anchor"], batch["positive"]


def text_id(text):
    """A text's id in the false-negative masks: equal texts, equal ids, on every process and in every run (a
    hash, where Python's hash() is salted per process); 63 bits, so that it is >= 0 as an int64."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
