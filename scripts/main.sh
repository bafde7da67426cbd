#!/usr/bin/env bash
# The README's main command: set up, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
exec .venv/bin/vaswani-tx params configs/model "$@"
