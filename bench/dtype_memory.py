"""Peak memory of a LoRA training step with the frozen base in float32 against --model_dtype bfloat16.

A tiny Qwen2 decoder built here (no download; --hidden_size, --num_layers), last-token pooled, loaded as
train.py loads it (load_model with model_options, prepare_model with --lora_r 8): one gradcache_step on a
batch of anchor, positive and negative texts of data/wordnet_train.jsonl.gz, then AdamW on the adapter.
Each dtype runs in a fresh process. The readings:
  - the parameters, counted: base and adapter bytes (what the dtype halves);
  - the step's peak above the memory just before it (activations, the adapter's gradients and AdamW's
    state): CPU, the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs;
    bench/harness.py); CUDA, max_memory_allocated;
  - their sum, base + adapter + step peak: what the step needs, the model included;
  - the process's peak from before the model loads to after the step. On CUDA the same allocator; on CPU
    it misleads: float32 weights stay mapped from the safetensors file and count only where touched (most
    embedding rows never are), while a bfloat16 load reads them all and converts.

    python bench/dtype_memory.py                   # CPU, about a minute
    python bench/dtype_memory.py --device cuda     # the same on a GPU
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import torch

import gradcache
import train
from train_parts import models
from train_parts.common import flags_of

DTYPES = ("float32", "bfloat16")


def build_decoder(folder, hidden_size, num_layers, vocab_size):
    """A random Qwen2 (a byte-level tokenizer of single bytes), saved as a SentenceTransformer in float32."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<|endoftext|>": 0} | {c: i + 1 for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    end = "<|endoftext|>"
    tokenizer = transformers.Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token=end, pad_token=end, padding_side="left"
    )
    heads = max(1, hidden_size // 64)  # of 64 dimensions, as Qwen2's; two key-value heads where they divide
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=2 if heads % 2 == 0 else 1,
        intermediate_size=hidden_size * 11 // 4,
        max_position_embeddings=512, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2Model(config).save_pretrained(folder / "qwen2")
    tokenizer.save_pretrained(folder / "qwen2")
    modules = [Transformer(str(folder / "qwen2")), Pooling(hidden_size, "lasttoken"), Normalize()]
    SentenceTransformer(modules=modules).save(str(folder / "model"))
    return folder / "model"


def measure(folder, dtype, device, batch_size, chunk_size, max_seq_length):
    """{dtype, parameter bytes (base, adapter), process peak, step peak} of one LoRA step."""
    args = train.parse_args(
        ["--model", str(folder), "--data", "unused.jsonl", "--lora_r", "8", "--model_dtype", dtype]
        + ["--max_seq_length", str(max_seq_length)]
    )
    texts = harness.load_texts(batch_size)
    baseline = harness.start_peak_window(device)
    model = models.prepare_model(
        models.load_model(args.model, device, **models.model_options(flags_of(models.ModelFlags, args))),
        flags_of(models.ModelFlags, args),
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    loss_fn = train.loss_function(args, model)
    columns, inputs = harness.gradcache_inputs(model, harness.text_batch(model, texts, 0, batch_size))
    load_peak = harness.peak_since_window(device)
    before_step = harness.start_peak_window(device)  # a new window: the step's own peak
    gradcache.gradcache_step(model, columns, loss_fn, chunk_size=chunk_size, **inputs)
    optimizer.step()
    step_peak = harness.peak_since_window(device)
    return {
        "dtype": dtype,
        "base_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
        "adapter_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "adapter_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in trainable}),
        "process_peak_bytes": max(load_peak, step_peak) - baseline,
        "step_peak_bytes": step_peak - before_step,
    }


def table(points):
    rows = [
        "| base dtype | base weights | adapter (dtype) | step peak | base + adapter + step | process peak |",
        "|---|---|---|---|---|---|",
    ]
    for point in points:
        point["held_bytes"] = point["base_bytes"] + point["adapter_bytes"] + point["step_peak_bytes"]
        base, adapter, step, held, process = (
            harness.mib(point[f"{part}_bytes"])
            for part in ("base", "adapter", "step_peak", "held", "process_peak")
        )
        rows.append(
            f"| {point['dtype']} | {base} | {adapter} ({', '.join(point['adapter_dtypes'])}) | {step} | "
            f"{held} | {process} |"
        )
    first, second = points
    ratios = ", ".join(
        f"{name} {second[f'{part}_bytes'] / first[f'{part}_bytes']:.2f}"
        for name, part in (("base", "base"), ("step peak", "step_peak"), ("base + adapter + step", "held"))
    )
    return "\n".join(rows) + f"\n\nMiB. {second['dtype']} / {first['dtype']}: {ratios}"


def main(argv=None):
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    options.add_argument("--device", default="cpu")
    options.add_argument("--hidden_size", type=int, default=768)
    options.add_argument("--num_layers", type=int, default=4)
    options.add_argument("--vocab_size", type=int, default=64000)
    options.add_argument("--batch_size", type=int, default=32)
    options.add_argument("--chunk_size", type=int, default=8)
    options.add_argument("--max_seq_length", type=int, default=32)
    options.add_argument("--worker", help=argparse.SUPPRESS)  # a JSON of measure's arguments
    args = options.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(**json.loads(args.worker))))
        return
    with tempfile.TemporaryDirectory() as folder:
        model = build_decoder(Path(folder), args.hidden_size, args.num_layers, args.vocab_size)
        points = []
        for dtype in DTYPES:  # each in a fresh process: nothing of the other stays resident
            job = dict(folder=str(model), dtype=dtype, device=args.device, batch_size=args.batch_size,
                       chunk_size=args.chunk_size, max_seq_length=args.max_seq_length)  # fmt: skip
            command = [sys.executable, __file__, "--worker", json.dumps(job)]
            env = os.environ | harness.MALLOC_ENV  # as bench/harness.py measures: big blocks mmapped, freed
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"{dtype}: {done.stderr[-3000:]}")
            points.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"LoRA r=8 step on a Qwen2 decoder (hidden {args.hidden_size}, {args.num_layers} layers, vocabulary "
        f"{args.vocab_size}), batch {args.batch_size} x 3 texts of up to {args.max_seq_length} tokens, "
        f"chunks of {args.chunk_size}, {args.device}:\n"
    )
    print(table(points))
    return points


if __name__ == "__main__":
    main()
