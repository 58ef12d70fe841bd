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
from references import Exactness, assert_exact, relative_error
from test_train import free_port
from test_train import launch as launch_train

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
weights = [x for p in model.parameters() for x in p.detach().float().flatten().tolist()]  # every digit
print(
    f"RESULT rank={accelerator.process_index} num_processes={accelerator.num_processes}"
    f" type={accelerator.distributed_type.value} precision={accelerator.mixed_precision}"
    f" dtype={next(model.parameters()).dtype} checksum={checksum:.6f} weights={weights}\\n",
    end="",  # one write per line: two ranks printing at once must not glue their lines together
    flush=True,
)
accelerator.end_training()  # as train.py ends: the process group destroyed, not left to interpreter exit
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
        stdin=subprocess.DEVNULL,  # not pytest-xdist's channel to its worker
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def reference_checksum(processes: int, precision: str, deepspeed: bool) -> float:
    return float(reference_weights(processes, precision, deepspeed).sum())


def reference_weights(processes: int, precision: str, deepspeed: bool, dtype=torch.float32, steps=2):
    """The probe's `steps` steps in this process, without accelerate, its weights flattened (float64).
    A step's batch is the `processes` batches of 2 rows that accelerate deals out, whose gradients DDP and
    ZeRO average. accelerate's bf16 is autocast; DeepSpeed's keeps the weights in bf16 and steps an fp32 copy
    made from them, and DeepSpeed clips at 1.0 (accelerate's value for the JSON's "auto"). `dtype` (without
    bf16): the precision of the weights and of every operation, float64 for the truth."""
    bf16_weights = deepspeed and precision == "bf16"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 1))
    data = torch.randint(0, 16, (8, 3))
    weights = model.to(torch.bfloat16) if bf16_weights else model.to(dtype)
    master = copy.deepcopy(weights).to(torch.float32 if bf16_weights else dtype)
    optimizer = torch.optim.AdamW(master.parameters(), lr=0.1)
    for step in range(steps):
        ids = data[2 * processes * step : 2 * processes * (step + 1)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16" and not deepspeed):
            weights(ids).float().pow(2).mean().backward()
        for copied, weight in zip(master.parameters(), weights.parameters(), strict=True):
            copied.grad, weight.grad = weight.grad.to(copied.dtype), None
        if deepspeed:
            torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for copied, weight in zip(master.parameters(), weights.parameters(), strict=True):
                weight.copy_(copied)
    return torch.cat([weight.detach().double().flatten() for weight in weights.parameters()])


# accelerate's bf16 is autocast: the weights stay fp32, every matrix product rounds to 8 significant bits
# (4e-3), and how a CPU's bf16 kernels round is its own. Budget against the float64 truth of the fp32 run:
# the updates within 30% (tests/backend_worker.py's bf16 update budget); a structural error costs order 1.
BF16_AUTOCAST_UPDATE = 0.3


def check_ranks(output: str, expected: str, num_processes: int) -> None:
    # Judged on what the ranks printed, not on the exit code: DeepSpeed on CPU sometimes aborts
    # at interpreter exit after the work is done.
    results = re.findall(r"RESULT rank=(\d+) (.*?) checksum=(-?\d+\.\d{6}) weights=(\[.*?\])", output)
    assert sorted(int(rank) for rank, _, _, _ in results) == list(range(num_processes)), output[-3000:]
    assert {fields for _, fields, _, _ in results} == {expected}
    # Every rank trained the model the probe trains here without accelerate (one process agreeing with
    # itself would prove nothing): gradients synced, batches sharded, precision and clipping as configured.
    precision = re.search(r"precision=(\w+)", expected)[1]
    deepspeed = "type=DEEPSPEED" in expected
    if precision == "bf16" and deepspeed:
        # DeepSpeed's bf16 keeps the weights in bf16: another rounding order may leave one of them a bf16
        # ulp (2^-8 of a weight near 1) from the reference's, which rounds as DeepSpeed does.
        reference = reference_checksum(num_processes, precision, deepspeed)
        for rank, _, checksum, _ in results:
            assert float(checksum) == pytest.approx(reference, abs=2**-7), f"rank {rank} trained otherwise"
        return
    # fp32 weights: every weight's update by references.py's rule (float64 truth, the float32 reference's
    # own distance), the reference one step short (a lost step) failing it; bf16 autocast: within its budget
    # of the same truth, and the run one step short outside it.
    initial = reference_weights(num_processes, "no", deepspeed, torch.float64, steps=0)
    float32, truth, one_step = (
        reference_weights(num_processes, "no", deepspeed, dtype, steps) - initial
        for dtype, steps in ((torch.float32, 2), (torch.float64, 2), (torch.float64, 1))
    )
    for rank, _, _, printed in results:
        run = torch.tensor(json.loads(printed), dtype=torch.float64) - initial
        if precision == "bf16":
            error = relative_error(run, truth)
            print(f"{expected}, rank {rank}: update {error:.1e} from the fp32 truth (budget 0.3)")
            assert error <= BF16_AUTOCAST_UPDATE, f"rank {rank} trained otherwise: {error:.1e}"
            assert relative_error(one_step, truth) > BF16_AUTOCAST_UPDATE  # the budget tells a lost step
            continue
        measured = assert_exact(run, float32, truth, f"rank {rank}, updates")
        control = Exactness(relative_error(run, one_step), measured.e_ref)
        assert not control.holds, f"rank {rank} matches the reference one step short: {control}"
        print(f"{expected}, rank {rank}: updates {measured}; against one step short {control.error:.1e}")


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
    try:
        output = "".join(node.communicate(timeout=300)[0] for node in nodes)
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        outputs = [node.communicate()[0][-3000:] for node in nodes]
        pytest.fail(f"a node did not exit within 300 s; node 0:\n{outputs[0]}\nnode 1:\n{outputs[1]}")
    check_ranks(output, f"num_processes=2 type=MULTI_CPU {FP32}", 2)


def test_a_deepspeed_config_that_accelerate_runs_as_ddp_stops_in_one_line(
    tmp_path, data, model_without_dropout
):
    """ACCELERATE_USE_CPU (cpu_ddp_2proc.yaml's variable, left in a job's shell) turns a DeepSpeed config into
    plain DDP inside accelerate: the run stops before training, naming the variable."""
    done = launch_train(
        CONFIGS / "deepspeed_zero2.yaml", tmp_path, "--model", model_without_dropout, "--data", data[0],
        "--max_steps", 1, "--wandb_mode", "disabled",
        processes=2, env={"ACCELERATE_USE_CPU": "true"}, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "a DeepSpeed accelerate config, but accelerate runs these processes as MULTI_CPU" in done.stderr
    assert "ACCELERATE_USE_CPU=true turns DeepSpeed off" in done.stderr
    assert not (tmp_path / "checkpoints").exists()
