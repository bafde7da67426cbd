#!/usr/bin/env bash
# The README's test command: set up, then run the default (non-slow) test suite.
# pytest exits 5 when no test ran; that is non-zero, so this script (and CI) fails then.
# The demo's browser test needs Debian's chromium and chromium-driver: they are installed here when missing, as
# root with apt-get, only when asked (CI=true, or VASWANI_INSTALL_CHROMIUM=1, which .ci/run sets); elsewhere
# that test is skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ "${VASWANI_INSTALL_CHROMIUM:-}" == 1 || "${CI:-}" == true ]] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
    echo "scripts/test.sh: installing chromium and chromium-driver for the demo's browser test" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation >/dev/null
fi
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
