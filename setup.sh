#!/usr/bin/env bash
# Creates .venv with the pinned requirements. With --dev it also installs what the tests need
# beyond Python packages: WordNet 3.0 (Debian's wordnet-base), the source of the bundled data set.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--dev" ] && [ ! -f /usr/share/wordnet/data.noun ]; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq wordnet-base >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq wordnet-base >/dev/null; fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
if [ "${1:-}" = "--dev" ]; then
  # DeepSpeed compiles its CPU communication extension at its first launch (a minute on 2 cores): here,
  # once, rather than inside the first DeepSpeed test. Into this checkout's own cache, where the tests'
  # launches look (tests/conftest.py): checkouts sharing the per-user one rebuilt it in turn, 87 s each.
  TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" DS_ACCELERATOR=cpu .venv/bin/python -c "from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load()" >/dev/null ||
    echo "setup.sh: DeepSpeed's CPU extension did not build here; its first launch will try again" >&2
fi
