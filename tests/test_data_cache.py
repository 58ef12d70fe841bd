"""The conversion of --data sources into memory-mapped Arrow tables (train_parts/records.py, through
pairs.load_pairs): the table holds what the raw records hold (read here with json, not with pairs.py), it is
reused without reading the source, converted again when the source or the options change, whole when two
processes convert at once, and a cache folder that cannot be written stops in one line naming the variable
that moves it. The batch order over it is the order over the same records held in memory."""

import itertools
import json
import multiprocessing
import os
import random
import signal
import socket
import time

import datasets
import numpy
import pytest
import torch

from train_parts import pairs, records


def write_triples(path, count, seed=0, bad_line=None):
    """`count` JSON lines of anchor, positive (a list of two every third record), two negatives; with
    `bad_line`, that line is not JSON."""
    draw, lines = random.Random(seed), []
    for i in range(count):
        words = " ".join(draw.choice(["cat", "dog", "sun", "sea", "red", "ink"]) for _ in range(6))
        positive = [f"p{i} {words}", f"q{i}"] if i % 3 == 0 else f"p{i} {words}"
        record = {"query": f"a{i} {words}", "pos": positive, "neg": [f"n{i} one", f"n{i} two"], "id": i}
        lines.append("{not json" if i + 1 == bad_line else json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def raw_examples(path):
    """The examples the records of a JSON lines file should give, read here with json alone."""
    examples = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        examples.append(
            {"anchor": record["query"], "positive": record["pos"] if isinstance(record["pos"], list) else
             [record["pos"]], "negative_1": record["neg"][0], "negative_2": record["neg"][1]}
        )  # fmt: skip
    return examples


def rows(table):
    return [row | {"positive": list(row["positive"])} for row in table]


def test_the_table_holds_the_raw_records_and_is_reused_without_reading_the_source(
    tmp_path, monkeypatch, capsys
):
    source = write_triples(tmp_path / "triples.jsonl", 50, bad_line=7)
    table, skipped = pairs.load_pairs(str(source), skip_bad_records=True)
    said = capsys.readouterr().out
    assert (skipped, rows(table)) == (1, raw_examples(source))
    assert "query" in said and "skipped 1 bad records; the first:" in said and "line 7" in said
    cache = records.cache_root()  # memory-mapped from the cache's file, not held in memory
    assert [file["filename"].startswith(str(cache)) for file in table.cache_files] == [True]

    def read_again(*_):
        raise AssertionError("the source was read again")

    monkeypatch.setattr(pairs, "read_records", read_again)
    again, skipped_again = pairs.load_pairs(str(source), skip_bad_records=True)
    assert (skipped_again, rows(again)) == (1, raw_examples(source))
    assert capsys.readouterr().out == said  # the field line and the skipped count, said again


def test_a_source_changed_on_disk_or_read_with_other_options_is_converted_again(tmp_path):
    source = write_triples(tmp_path / "triples.jsonl", 30, seed=1)
    first, _ = pairs.load_pairs(str(source))
    times = source.stat().st_atime_ns, source.stat().st_mtime_ns
    write_triples(source, 30, seed=2)  # the same size: other words of as many letters
    os.utime(source, ns=times)  # ... and the same time, as a rewrite within the clock's tick
    assert rows(pairs.load_pairs(str(source))[0]) == raw_examples(source) != rows(first)
    with pytest.raises(pairs.DataError, match=r"over --max_text_chars 10"):
        pairs.load_pairs(str(source), max_text_chars=10)  # the checks of other options run again
    source.write_text(source.read_text() + json.dumps({"query": "new", "pos": "one", "neg": ["x", "y"]}))
    assert rows(pairs.load_pairs(str(source))[0]) == raw_examples(source)


def convert_in_a_process(source, barrier, results):
    barrier.wait()  # both start together: both find no conversion and convert
    try:
        results.put(rows(pairs.load_pairs(str(source))[0]))
    except Exception as error:
        results.put(f"{type(error).__name__}: {error}")


def test_two_processes_converting_at_once_leave_one_whole_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv(records.CACHE_VARIABLE, str(tmp_path / "cache"))
    source = write_triples(tmp_path / "triples.jsonl", 20_000)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=convert_in_a_process, args=(source, barrier, results)) for _ in "ab"]
    for worker in workers:
        worker.start()
    tables = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join()
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert tables[0] == tables[1] == raw_examples(source)
    assert [path.name.split("-")[0] for path in (tmp_path / "cache").iterdir()] == ["triples.jsonl"]
    assert rows(pairs.load_pairs(str(source))[0]) == raw_examples(source)  # the one kept, whole


def test_a_conversion_killed_halfway_leaves_no_part_behind_the_next_one(tmp_path, monkeypatch):
    """A conversion killed (the scheduler's SIGKILL, the kernel's out-of-memory killer) left its half-written
    <name>.part-* folder in the cache for ever; the next conversion of the source removes it. A part of a
    live process (converting now) or of another machine sharing the folder stays."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(records.CACHE_VARIABLE, str(cache))
    source = write_triples(tmp_path / "triples.jsonl", 30_000)
    context = multiprocessing.get_context("fork")
    killed = context.Process(target=pairs.load_pairs, args=(str(source),))
    killed.start()
    deadline = time.monotonic() + 120
    while not list(cache.glob("triples.jsonl-*.part-*/examples.arrow")) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(killed.pid, signal.SIGKILL)
    killed.join()
    (abandoned,) = cache.glob("triples.jsonl-*.part-*")
    assert f"{socket.gethostname()}-{killed.pid}-" in abandoned.name
    live = cache / abandoned.name.replace(f"-{killed.pid}-", f"-{os.getpid()}-")
    elsewhere = cache / abandoned.name.replace(socket.gethostname(), "another-node")
    live.mkdir(), elsewhere.mkdir()
    assert rows(pairs.load_pairs(str(source))[0]) == raw_examples(source)
    assert sorted(cache.glob("triples.jsonl-*.part-*")) == sorted([live, elsewhere])


def test_a_save_to_disk_folder_is_used_in_place_unless_a_record_needs_the_conversion(
    tmp_path, monkeypatch, capsys
):
    """A save_to_disk folder is Arrow on disk already: its columns are used where they lie (no copy in the
    cache), giving the rows the conversion of the same records gives. A bad text in it goes through the
    conversion, which names it or, with --skip_bad_records, leaves it out."""
    monkeypatch.setenv(records.CACHE_VARIABLE, str(tmp_path / "cache"))
    draw = random.Random(0)
    records_ = [
        {"id": i, "neg2": f"m{i}", "query": f"a{i} {draw.random()}", "pos": f"p{i}", "neg1": f"n{i} \u00e9"}
        for i in range(500)
    ]
    jsonl = tmp_path / "triples.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records_))
    datasets.Dataset.from_list(records_).save_to_disk(str(tmp_path / "saved"))
    converted, _ = pairs.load_pairs(str(jsonl), "negatives=neg1+neg2")
    in_place, skipped = pairs.load_pairs(str(tmp_path / "saved"), "negatives=neg1+neg2")
    assert skipped == 0 and in_place.to_list() == converted.to_list()
    assert [row["negative_2"] for row in in_place] == [record["neg2"] for record in records_]
    assert all(file["filename"].startswith(str(tmp_path / "saved")) for file in in_place.cache_files)
    assert [folder.name.split("-")[0] for folder in (tmp_path / "cache").iterdir()] == ["triples.jsonl"]
    assert f"(used in place: {tmp_path / 'saved'})" in capsys.readouterr().out
    # A hub data set: datasets' cached copy, memory-mapped as a saved folder is (standing in for it here)
    with monkeypatch.context() as hub_path:
        hub_path.setattr(pairs, "locate_data", lambda source, flag: ("hub", source, None))
        hub_path.setattr(pairs, "open_dataset", lambda *_: datasets.load_from_disk(str(tmp_path / "saved")))
        hub, _ = pairs.load_pairs("org/triples", "negatives=neg1+neg2")
    assert hub.to_list() == converted.to_list() and hub.cache_files == in_place.cache_files

    records_[7]["pos"] = (
        " \x1c\u3000"  # blank to Python's isspace and to Arrow's trim: the conversion names it
    )
    datasets.Dataset.from_list(records_).save_to_disk(str(tmp_path / "blank"))
    with pytest.raises(pairs.DataError, match=r"record 8 has field 'pos' empty"):
        pairs.load_pairs(str(tmp_path / "blank"))
    kept, skipped = pairs.load_pairs(str(tmp_path / "blank"), "negatives=neg1+neg2", skip_bad_records=True)
    assert skipped == 1 and kept.to_list() == converted.to_list()[:7] + converted.to_list()[8:]
    assert not kept.cache_files[0]["filename"].startswith(str(tmp_path / "blank"))  # converted, cached


def test_a_cache_folder_that_cannot_be_written_stops_in_one_line_naming_the_variable(tmp_path, monkeypatch):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv(records.CACHE_VARIABLE, str(blocked / "cache"))
    source = write_triples(tmp_path / "triples.jsonl", 5)
    with pytest.raises(pairs.DataError) as error:
        pairs.load_pairs(str(source))
    message = str(error.value)
    assert "\n" not in message and "cannot write the data cache" in message
    assert f"Set {records.CACHE_VARIABLE} to a writable folder" in message


def test_the_batch_order_over_the_table_is_the_order_over_the_records_in_memory_and_replays(tmp_path):
    source = write_triples(tmp_path / "triples.jsonl", 64, seed=3)
    in_memory = datasets.Dataset.from_list(raw_examples(source))
    order = pairs.BatchOrder(batch_size=8, seed=5)

    def batches(data, epoch):
        loader = pairs.make_loader([data], order)
        loader.sampler.set_epoch(epoch)
        return [json.dumps(batch, sort_keys=True) for batch in loader]

    converted, _ = pairs.load_pairs(str(source))
    expected = [batches(in_memory, epoch) for epoch in (0, 1)]
    assert [batches(converted, epoch) for epoch in (0, 1)] == expected
    reused, _ = pairs.load_pairs(str(source))  # what a resume reads: the same batches, epoch 1 first
    assert [batches(reused, epoch) for epoch in (1, 0)] == expected[::-1]
    assert expected[0] != expected[1]


def test_the_batch_order_is_sentence_transformers_rule_over_the_same_shuffles(monkeypatch):
    """pairs.NoDuplicatesOrder, streamed, against sentence-transformers' NoDuplicatesBatchSampler given the
    same shuffles (its torch.randperm replaced by pairs.shuffled's orders): texts from small pools, so that
    many examples wait for a later batch and an epoch needs passes in new orders; the positives drawn from
    lists each epoch as PositiveDraws documents it (random.Random(f"{seed}:{epoch}:{index}"))."""
    from sentence_transformers.base import sampler as st_sampler

    draw, size, batch_size, seed = random.Random(7), 240, 8, 5
    columns = {
        "anchor": [f"q{draw.randrange(70)}" for _ in range(size)],
        "positive": [[f"d{draw.randrange(90)}" for _ in range(draw.randrange(1, 4))] for _ in range(size)],
        "negative_1": [f"d{draw.randrange(90)}" for _ in range(size)],
    }
    order = pairs.NoDuplicatesOrder(datasets.Dataset.from_dict(columns), batch_size, seed)
    for epoch in (0, 3):
        ours = list(order.indices(epoch))
        drawn = [texts[random.Random(f"{seed}:{epoch}:{i}").randrange(len(texts))]
                 for i, texts in enumerate(columns["positive"])]  # fmt: skip
        shown = datasets.Dataset.from_dict(columns | {"positive": drawn})
        shuffles = (pairs.shuffled(size, f"{seed}:{epoch}:{extra}") for extra in itertools.count())

        def same_shuffles(*_, dtype, shuffles=shuffles, **__):
            return torch.from_numpy(numpy.concatenate(list(next(shuffles)))).to(dtype)

        monkeypatch.setattr(st_sampler.torch, "randperm", same_shuffles)
        reference = st_sampler.NoDuplicatesBatchSampler(shown, batch_size, drop_last=True)
        expected = [index for batch in reference for index in batch]
        monkeypatch.undo()
        assert ours == expected
        first_pass = [index for batch in order.one_pass(epoch, 0) for index in batch]
        assert len(first_pass) < len(order), "no pass in a new order was needed: the case is too easy"
        in_shuffle = numpy.concatenate(list(pairs.shuffled(size, f"{seed}:{epoch}:0")))
        assert first_pass != [i for i in in_shuffle.tolist() if i in set(first_pass)], "no example waited"


def test_the_batch_order_holds_no_index_per_example():
    """The first 20 batches of an epoch of 2^20 examples, of one source and of two mixed: Python's and
    numpy's allocations (tracemalloc) stay under a quarter of an int64 index per example (torch.randperm's
    order and sentence-transformers' linked list of positions take 8 bytes an example; torch's allocations
    are not traced, numpy's are)."""
    import tracemalloc

    size = 1 << 20
    data = datasets.Dataset.from_dict(
        {"anchor": [f"a{i}" for i in range(size)], "positive": [f"p{i}" for i in range(size)]}
    )
    for sets in ([data], [data, data]):
        loader = pairs.make_loader(sets, pairs.BatchOrder(batch_size=64, seed=1))
        tracemalloc.start()
        batches = list(itertools.islice(loader, 20))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(batches) == 20 and peak < size * 8 / 4, f"{len(sets)} source(s): {peak / 2**20:.1f} MiB"


def test_the_positives_of_each_anchor_are_collected_from_the_table_as_from_the_raw_records(
    tmp_path, monkeypatch
):
    """train.positives_by_anchor (records.py's) over a converted table, against ids computed here from the
    JSON lines; the answer is kept in the data cache and read back by the next run, but never for another
    table: a selection of the rows (--max_train_examples) or a source changed on disk searches again."""
    import hashlib

    import train

    def text_id(text):  # the ids of the masks, as train.py documents them: blake2b, 8 bytes, shifted
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def expected_of(lines):
        expected = {}
        for line in lines:
            expected.setdefault(text_id(line["anchor"]), set()).update(map(text_id, line["positive"]))
        return {anchor: sorted(ids) for anchor, ids in expected.items() if len(ids) > 1}

    def searched(table):  # (the answer, whether the records were searched rather than the cache read)
        calls = []
        monkeypatch.setattr(records, "find_positives_by_anchor", lambda sets: calls.append(1) or search(sets))
        return train.positives_by_anchor(table), bool(calls)

    search = records.find_positives_by_anchor
    monkeypatch.setenv(records.CACHE_VARIABLE, str(tmp_path / "cache"))
    draw = random.Random(4)
    lines = [{"anchor": f"q{draw.randrange(40)}", "positive": [f"p{draw.randrange(9)}" for _ in range(
        draw.randrange(1, 3))], "negative": f"n{i}"} for i in range(300)]  # fmt: skip
    lines.append({"anchor": "alone", "positive": ["one", "two"], "negative": "n"})  # several in one record
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    expected = expected_of(lines)
    assert text_id("alone") in expected
    assert searched(pairs.load_pairs(str(source))[0]) == (expected, True)
    assert len(list((tmp_path / "cache" / "known_positives").glob("*.json"))) == 1
    assert searched(pairs.load_pairs(str(source))[0]) == (expected, False)  # the next run reads the cache
    chosen = pairs.load_pairs(str(source))[0].shuffle(seed=1, keep_in_memory=True)
    chosen = chosen.select(range(100), keep_in_memory=True)  # as train.load_data keeps --max_train_examples
    rows = [{"anchor": row["anchor"], "positive": row["positive"]} for row in chosen]
    assert searched(chosen) == (expected_of(rows), True)
    assert expected_of(rows) != expected
    lines[0] = {"anchor": "alone", "positive": ["three"], "negative": "n"}
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))  # changed on disk
    assert searched(pairs.load_pairs(str(source))[0]) == (expected_of(lines), True)
    assert expected_of(lines) != expected
