"""What every part of train.py shares: the one-line failure, the version check, whether a server answers.

Flags served: none of its own; `flags_of` hands each part the flags it declares (a frozen dataclass whose
fields are named as the flags).
"""

import dataclasses
import functools
import importlib.metadata
import json
import os
import re
import socket
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import huggingface_hub

__all__ = [
    "fail",
    "print_error",
    "check_versions",
    "flags_of",
    "unreachable",
    "is_hub_name",
    "hub_out_of_reach",
]


def fail(message):
    """Stop with one line that says what to do, no traceback: printed once main has unwound (closing the
    progress bar), exit status 2 (train.py's last lines)."""
    raise SystemExit(f"train.py: error: {message}")


def print_error(line):
    """The error line on stderr and, under torchrun, in the error file its failure summary prints as the root
    cause (accelerate's one-process launcher adds a traceback to any non-zero exit unless --quiet). Under
    torchrun only the first process prints it: the others' lines, most often the same, reach the summary."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))


def check_versions(minimums, needed_for=""):
    """Stop if a package is missing or older than its minimum, naming the pip command."""
    for package, minimum in minimums.items():
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        major_minor = [tuple(int(p) for p in re.findall(r"\d+", v)[:2]) for v in (installed or "0", minimum)]
        if installed is None or major_minor[0] < major_minor[1]:
            fail(
                f"it needs {package}>={minimum}{needed_for}, "
                f"{'not installed' if installed is None else f'found {installed}'}. "
                f'Install a newer one: pip install "{package}>={minimum}"'
            )


def flags_of(settings_class, args):
    """A part's frozen settings (`settings_class`, its fields named as the flags it reads) from the flags."""
    return settings_class(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(settings_class)}
    )


def unreachable(url):
    """Why the server of `url` cannot be reached ("" when it answers within 3 s): without network the hub and
    wandb clients retry each request for tens of seconds, then end in a traceback."""
    server = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((server.hostname, server.port or 443), timeout=3).close()
    except OSError as err:
        return f"no network: {server.hostname} did not answer ({err})"
    return ""


def is_hub_name(name):
    """Whether `name` could be a hub repository (org/name): ./x, ~/x and a/b/c cannot."""
    try:
        huggingface_hub.utils.validate_repo_id(name)
    except huggingface_hub.errors.HFValidationError:
        return False
    return True


@functools.cache
def hub_out_of_reach():
    """Why the hub cannot be reached ("" when it can): HF_HUB_OFFLINE, or no answer within 3 s (a misspelled
    model took 100 s of retries without network)."""
    if huggingface_hub.constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    if urllib.request.getproxies().get("https"):
        return ""  # reached through the proxy, which a direct connection cannot probe
    return unreachable(huggingface_hub.constants.ENDPOINT)
