"""Data beyond memory: a synthetic JSON lines file of N triples (generated here, never committed), read by
train.py's own data path (load_data, positives_by_anchor, make_loader, accelerate's prepared loader) in 2
processes up to the first batch of the first step: once converting (train_parts/records.py), once reusing
the conversion and the known positives that the first launch kept in the data cache; then train.py itself
trains 3 steps on it (the bundled model, 2 processes), its processes' memory read from outside. Today's
reading (pairs.load_pairs of commit 90948cf: records into Python lists, then Dataset.from_dict) is timed
side by side on the first records of the smallest file.

    python bench/data_scale.py --sizes 1000000 3000000 10000000

Memory: each process's anonymous resident memory (RssAnon: what is its own, not the memory-mapped table's
pages, which are the OS's file cache shared by the processes) at the first batch and at its highest, less
what it held before reading the data (the libraries, and a model would come on top of both). Writes
bench/results/data_scale_cpu.json and .md; make_results.py puts them into RESULTS.md.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TODAY = "90948cf"  # the commit whose load_pairs read every record into Python lists
WORDS = [f"{a}{b}{c}" for a in "bcdfghklmnprst" for b in "aeiou" for c in "lmnrstxz"]  # 560 words


def generate(path, count, seed=0):
    """`count` JSON lines of query, pos, neg: 12, 30 and 30 words (about 550 bytes a record)."""
    draw = random.Random(seed)
    with open(path, "w") as out:
        for i in range(count):
            query, pos, neg = (" ".join(draw.choices(WORDS, k=k)) for k in (12, 30, 30))
            out.write(json.dumps({"query": f"{i} {query}", "pos": f"{i} {pos}", "neg": f"{i} {neg}"}) + "\n")


def rss_anon(pid="self"):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(data, batch_size, started, readings):
    """One of the 2 processes: train.py's data path to the first batch; its readings into `readings`/."""
    sys.path.insert(0, str(REPO))
    from accelerate import Accelerator

    import train
    from train_parts.launch import main_process_first

    args = train.parse_args(["--data", data, "--dev_data", "", "--batch_size", str(batch_size)])
    accelerator, sources = Accelerator(cpu=True), train.source_settings(args)
    before, highest = rss_anon(), [0]

    def watch():
        while True:
            highest[0] = max(highest[0], rss_anon())
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    read_from = time.time()
    train_sets, _, _ = train.load_data(args, sources, accelerator)
    loaded = time.time()
    with main_process_first(accelerator):  # as train.py's source_steps: the first one fills the data cache
        train.positives_by_anchor(*train_sets)
    masks = time.time()
    loader = accelerator.prepare(train.make_loader(train_sets, args, accelerator.num_processes))
    next(iter(loader))
    first_batch = time.time()
    highest[0] = max(highest[0], rss_anon())
    reading = {
        "rank": accelerator.process_index, "load_data_s": loaded - read_from, "positives_s": masks - loaded,
        "first_batch_s": first_batch - started, "data_rss_anon": rss_anon() - before,
        "data_rss_anon_peak": highest[0] - before, "examples": len(train_sets[0]),
    }  # fmt: skip
    Path(readings, f"{accelerator.process_index}.json").write_text(json.dumps(reading))


# Both launches: accelerate's 2-process CPU config, one thread a process
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--config_file"]
LAUNCH += [str(REPO / "accelerate_configs" / "cpu_ddp_2proc.yaml")]


def environment():  # read at each launch: main sets GRADCACHE_DATA_CACHE first
    return os.environ | {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}


def two_processes(data, batch_size):
    """The readings of both processes of one launch, the launch's start the clock's zero."""
    started = time.time()
    readings = Path(data).parent / "readings"
    shutil.rmtree(readings, ignore_errors=True)
    readings.mkdir()
    command = [*LAUNCH, __file__, "--worker", data, str(batch_size), str(started), str(readings)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=environment())
    if done.returncode or len(list(readings.iterdir())) != 2:
        sys.exit(f"the launch failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads((readings / f"{rank}.json").read_text()) for rank in (0, 1)]


def trained(data, work, steps=3, batch_size=32):
    """train.py itself, as a user launches it (the bundled model, 2 processes, on the reused conversion)
    for `steps` steps: (seconds, the highest anonymous resident memory of each of its processes)."""
    command = [*LAUNCH, str(REPO / "train.py"), "--data", data, "--dev_data", "", "--max_steps", str(steps)]
    command += ["--batch_size", str(batch_size), "--chunk_size", "16", "--eval_steps", "0"]
    command += ["--save_steps", "0", "--wandb_mode", "disabled", "--output_dir", str(work / "run")]
    shutil.rmtree(work / "run", ignore_errors=True)
    started, highest = time.time(), {}
    with open(work / "train.log", "w") as log:
        launch = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=environment())
        while launch.poll() is None:
            for child in psutil.Process(launch.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    if "LOCAL_RANK" in child.environ():  # torchrun's workers, not the launcher
                        highest[child.pid] = max(highest.get(child.pid, 0), rss_anon(child.pid))
            time.sleep(0.2)
    if launch.returncode or len(highest) != 2:
        sys.exit(f"train.py failed: see {work / 'train.log'}")
    return time.time() - started, sorted(highest.values())


def todays_reading(data, records):
    """(seconds, records) of commit TODAY's load_pairs on the first `records` records, in its own process."""
    sample = Path(data).with_suffix(f".first{records}.jsonl")
    with open(data) as source, open(sample, "w") as out:
        out.writelines(line for _, line in zip(range(records), source, strict=False))
    old = Path(os.environ.get("TMPDIR", "/tmp")) / "gradcache_pairs_today.py"
    shown = subprocess.run(
        ["git", "show", f"{TODAY}:train_parts/pairs.py"], capture_output=True, text=True, check=True, cwd=REPO
    )
    old.write_text(shown.stdout.replace("from .common", "from train_parts.common"))
    code = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r}); import importlib.util as u\n"
        f"spec = u.spec_from_file_location('old_pairs', {str(old)!r}); m = u.module_from_spec(spec)\n"
        "spec.loader.exec_module(m); t = time.perf_counter()\n"
        f"m.load_pairs({str(sample)!r}, say=lambda _: 0)\n"
        "print(time.perf_counter() - t)"
    )
    seconds = float(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    return seconds, sample


def convert_alone(sample):
    """Seconds of today's conversion (records.py through pairs.load_pairs) of `sample`, in this process."""
    sys.path.insert(0, str(REPO))
    from train_parts import pairs

    started = time.perf_counter()
    pairs.load_pairs(str(sample), say=lambda _: 0)
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    parser.add_argument("--work", default="/tmp/gradcache_data_bench", help="the generated files and cache")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--sample", type=int, default=200_000, help="records timed against today's reading")
    parser.add_argument("--results_dir", default=str(BENCH_DIR / "results"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    os.environ["GRADCACHE_DATA_CACHE"] = str(work / "cache")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=REPO).stdout.strip()  # fmt: skip
    results = {"commit": commit.stdout.strip(), "dirty": bool(dirty), "date": time.strftime("%Y-%m-%d"),
               "cpus": os.cpu_count(), "load_average": os.getloadavg()[0], "sizes": []}  # fmt: skip
    for size in args.sizes:
        data = work / f"triples_{size}.jsonl"
        if not data.is_file():
            started = time.time()
            generate(data, size)
            print(f"generated {data} ({data.stat().st_size / 1e9:.2f} GB) in {time.time() - started:.0f} s")
        if size == args.sizes[0]:  # today's reading and the conversion, side by side on the same records
            shutil.rmtree(work / "cache", ignore_errors=True)
            today, sample = todays_reading(data, args.sample)
            ours = convert_alone(sample)
            results["rate"] = {"records": args.sample, "today_s": today, "conversion_s": ours}
            print(f"{args.sample} records: today's reading {today:.1f} s, the conversion {ours:.1f} s")
        shutil.rmtree(work / "cache", ignore_errors=True)
        converting, reusing = (
            two_processes(str(data), args.batch_size),
            two_processes(str(data), args.batch_size),
        )
        seconds, training_rss = trained(str(data), work)
        point = {"triples": size, "bytes": data.stat().st_size, "converting": converting, "reusing": reusing}
        point["training"] = {"steps": 3, "seconds": seconds, "rss_anon_peak": training_rss}
        results["sizes"].append(point)
        print(json.dumps(point))
        write(results, Path(args.results_dir))


MB = 2**20
RSS_TARGET, FIRST_STEP_TARGET = 300 * MB, 60.0


def write(results, folder):
    """The JSON and the markdown table of the results so far."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data_scale_cpu.json").write_text(json.dumps(results, indent=1))
    rows = [
        "| triples | file | conversion (2 processes, s) | first batch, converting (s) "
        "| first batch, reused (s) | data RSS a process, reused (MB, max of 2) | its peak (MB) "
        "| data RSS peak, converting (MB) | known positives, searched / reused (s) "
        "| train.py, 3 steps: peak RSS a process (MB, max of 2) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for point in results["sizes"]:
        converting, reusing = point["converting"], point["reusing"]
        rows.append(
            f"| {point['triples']:,} | {point['bytes'] / 1e9:.2f} GB | {converting[0]['load_data_s']:.0f} "
            f"| {max(r['first_batch_s'] for r in converting):.0f} "
            f"| {max(r['first_batch_s'] for r in reusing):.1f} "
            f"| {max(r['data_rss_anon'] for r in reusing) / MB:.0f} "
            f"| {max(r['data_rss_anon_peak'] for r in reusing) / MB:.0f} "
            f"| {max(r['data_rss_anon_peak'] for r in converting) / MB:.0f} "
            f"| {max(r['positives_s'] for r in converting):.1f} "
            f"/ {max(r['positives_s'] for r in reusing):.1f} "
            f"| {max(point['training']['rss_anon_peak']) / MB:.0f} |"
        )
    (folder / "data_scale_cpu.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        main()
