"""accelerate_configs/: every file loads as `accelerate launch` loads it; the CPU-capable ones train."""

import copy
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DeepSpeedPlugin, DistributedType
from test_train import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
YAMLS = sorted(CONFIGS.glob("*.yaml"))
DEEPSPEED_YAMLS = [p for p in YAMLS if p.name.startswith("deepspeed_")]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
# No GPU even where one exists, and one thread per process on small CI machines.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}

PROBE = """
import os

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

# Without a GPU, multi-process runs need gloo named explicitly; a lone process must not ask for it.
handlers = [InitProcessGroupKwargs(backend="gloo")] if "LOCAL_RANK" in os.environ else []
accelerator = Accelerator(kwargs_handlers=handlers)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.randint(0, 16, (8, 3)), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for _, ids in zip(range(2), loader):
    accelerator.backward(model(ids).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
checksum = sum(p.float().sum().item() for p in model.parameters())
print(
    f"RESULT rank={accelerator.process_index} num_processes={accelerator.num_processes}"
    f" type={accelerator.distributed_type.value} precision={accelerator.mixed_precision}"
    f" dtype={next(model.parameters()).dtype} checksum={checksum:.6f}\\n",
    end="",  # one write per line: two ranks printing at once must not glue their lines together
    flush=True,
)
"""

FP32 = "precision=no dtype=torch.float32"
BF16_DEEPSPEED = "precision=bf16 dtype=torch.bfloat16"
ONE_PROCESS = ["--num_processes", "1"]
# (config, extra launch arguments, extra environment, what every rank must report). cpu.yaml,
# cpu_ddp_2proc.yaml, deepspeed_zero3.yaml (2 processes, its JSON's parameter persistence threshold at 0)
# and deepspeed_zero2_offload_optimizer.yaml (1) are launched with train.py itself and compared with a plain
# run in tests/test_train.py; here the rest.
CPU_RUNS = [
    ("bf16.yaml", [], {}, "num_processes=1 type=NO precision=bf16 dtype=torch.float32"),
    ("deepspeed_zero1.yaml", ONE_PROCESS, {}, f"num_processes=1 type=DEEPSPEED {FP32}"),
    (
        "deepspeed_zero2.yaml",
        [*ONE_PROCESS, "--mixed_precision", "bf16"],
        {},
        f"num_processes=1 type=DEEPSPEED {BF16_DEEPSPEED}",
    ),
    (
        "deepspeed_zero3_offload_params.yaml",
        [*ONE_PROCESS, "--mixed_precision", "bf16"],
        {},
        f"num_processes=1 type=DEEPSPEED {BF16_DEEPSPEED}",
    ),
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


def start(config: str, args: list[str], env: dict[str, str], probe: Path) -> subprocess.Popen:
    """`accelerate launch` from the repository root, as the configs' own commands are run."""
    return subprocess.Popen(
        [*LAUNCH, f"accelerate_configs/{config}", *args, str(probe)],
        cwd=ROOT,
        env={**os.environ, **CPU_ENV, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reference_checksum(processes: int, precision: str, deepspeed: bool) -> float:
    """The probe's two steps in this process, without accelerate. A step's batch is the `processes`
    batches of 2 rows that accelerate deals out, whose gradients DDP and ZeRO average. accelerate's bf16 is
    autocast; DeepSpeed's keeps the weights in bf16 and steps an fp32 copy made from them, and DeepSpeed
    clips at 1.0 (accelerate's value for the JSON's "auto")."""
    bf16_weights = deepspeed and precision == "bf16"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 1))
    data = torch.randint(0, 16, (8, 3))
    weights = model.to(torch.bfloat16) if bf16_weights else model
    master = copy.deepcopy(weights).float()
    optimizer = torch.optim.AdamW(master.parameters(), lr=0.1)
    for step in range(2):
        ids = data[2 * processes * step : 2 * processes * (step + 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16" and not deepspeed):
            weights(ids).float().pow(2).mean().backward()
        for copied, weight in zip(master.parameters(), weights.parameters(), strict=True):
            copied.grad, weight.grad = weight.grad.float(), None
        if deepspeed:
            torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for copied, weight in zip(master.parameters(), weights.parameters(), strict=True):
                weight.copy_(copied)
    return sum(weight.float().sum().item() for weight in weights.parameters())


def check_ranks(output: str, expected: str, num_processes: int) -> None:
    # Judged on what the ranks printed, not on the exit code: DeepSpeed on CPU sometimes aborts
    # at interpreter exit after the work is done.
    results = re.findall(r"RESULT rank=(\d+) (.*?) checksum=(-?\d+\.\d{6})", output)
    assert sorted(int(rank) for rank, _, _ in results) == list(range(num_processes)), output[-3000:]
    assert {fields for _, fields, _ in results} == {expected}
    # Every rank trained the model the probe trains here without accelerate (one process agreeing with
    # itself would prove nothing): gradients synced, batches sharded, precision and clipping as configured.
    precision = re.search(r"precision=(\w+)", expected)[1]
    reference = reference_checksum(num_processes, precision, deepspeed="type=DEEPSPEED" in expected)
    # DeepSpeed's bf16 keeps the weights in bf16: another rounding order may leave one of them a bf16 ulp
    # (2^-8 of a weight near 1) from the reference's; fp32 weights (printed to 6 decimals) agree to 1e-5.
    tolerance = 2**-7 if precision == "bf16" and "type=DEEPSPEED" in expected else 1e-5
    for rank, _, checksum in results:
        assert float(checksum) == pytest.approx(reference, abs=tolerance), f"rank {rank} trained otherwise"


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_yaml_loads_and_names_its_own_command(path):
    config = load_config_from_file(str(path))
    assert (config.distributed_type == DistributedType.DEEPSPEED) == path.name.startswith("deepspeed_")
    lines = path.read_text().splitlines()
    header = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
    assert f"accelerate launch --config_file accelerate_configs/{path.name} " in header


@pytest.mark.parametrize("path", DEEPSPEED_YAMLS, ids=lambda p: p.name)
def test_deepspeed_json_is_accepted(path, monkeypatch):
    config = load_config_from_file(str(path))
    ds_file = ROOT / config.deepspeed_config["deepspeed_config_file"]
    ds_config = json.loads(ds_file.read_text())
    assert ds_config["gradient_accumulation_steps"] == ds_config["gradient_clipping"] == "auto"
    assert ds_config["fp16"]["enabled"] == ds_config["bf16"]["enabled"] == "auto"
    # As under `accelerate launch`: precision or ZeRO fields in the YAML next to a JSON raise here.
    yaml_fields = [*config.deepspeed_config, *(["mixed_precision"] if config.mixed_precision else [])]
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(yaml_fields).lower())
    zero3_init_flag = config.deepspeed_config.get("zero3_init_flag")
    plugin = DeepSpeedPlugin(hf_ds_config=str(ds_file), zero3_init_flag=zero3_init_flag)
    assert plugin.zero_stage == int(re.search(r"zero(\d)", path.name)[1])
    offloads = {plugin.offload_optimizer_device, plugin.offload_param_device} - {"none"}
    if "offload" in path.name:
        assert offloads == {"cpu"}
        # Otherwise accelerate swaps the script's torch optimizer for DeepSpeedCPUAdam.
        assert ds_config["zero_force_ds_cpu_optimizer"] is False
    else:
        assert not offloads


def test_every_deepspeed_json_is_used_and_zero3_saves_whole_weights():
    used = {load_config_from_file(str(p)).deepspeed_config["deepspeed_config_file"] for p in DEEPSPEED_YAMLS}
    files = sorted((CONFIGS / "deepspeed").glob("*.json"))
    assert used == {str(p.relative_to(ROOT)) for p in files}
    for path in files:
        zero = json.loads(path.read_text())["zero_optimization"]
        if zero["stage"] == 3:
            # "auto" becomes false, and accelerator.get_state_dict then refuses a ZeRO-3 model.
            assert zero["stage3_gather_16bit_weights_on_model_save"] is True, path.name


@pytest.mark.parametrize(("config", "args", "env", "expected"), CPU_RUNS, ids=[run[0] for run in CPU_RUNS])
def test_launch_on_cpu(config, args, env, expected, probe):
    process = start(config, [*args, "--main_process_port", str(free_port())], env, probe)
    output = process.communicate(timeout=300)[0]
    check_ranks(output, expected, int(re.search(r"num_processes=(\d+)", expected)[1]))


def test_multi_node_as_two_nodes_on_localhost(probe):
    port = str(free_port())
    nodes = [
        start(
            "multi_node.yaml",
            ["--num_processes", "2", "--machine_rank", str(rank)]
            + ["--main_process_ip", "127.0.0.1", "--main_process_port", port],
            {"ACCELERATE_USE_CPU": "true"},
            probe,
        )
        for rank in (0, 1)
    ]
    output = "".join(node.communicate(timeout=300)[0] for node in nodes)
    check_ranks(output, f"num_processes=2 type=MULTI_CPU {FP32}", 2)
