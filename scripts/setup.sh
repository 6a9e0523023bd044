#!/usr/bin/env bash
# Create .venv and install hetplan with its test extras. Idempotent and quick when nothing
# changed (a stamp keyed on pyproject.toml).
#
# torch is installed *before* the project so that its requirement is already satisfied:
#   - a machine whose python3 already imports torch (a GPU box) reuses it through
#     --system-site-packages: nothing is downloaded;
#   - otherwise `pip install "$HETPLAN_TORCH_SPEC"` (default torch==2.13.0). On CPU machines
#     point pip at a CPU wheel source, e.g.
#       PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
#     so that no CUDA wheels are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${HETPLAN_VENV:-.venv}
stamp="$VENV/.hetplan-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
echo "setting up $VENV ..." >&2
log=$(mktemp)
pip_install() {  # quiet on success, the whole log on failure
  if ! "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup: 'pip install $*' failed (log above)" >&2
    exit 1
  fi
}
if "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m venv --system-site-packages "$VENV"
  echo "reusing torch $("$PY" -c 'import torch; print(torch.__version__)') from $PY" >&2
else
  "$PY" -m venv "$VENV"
  pip_install "${HETPLAN_TORCH_SPEC:-torch==2.13.0}"
fi
pip_install -e ".[test]"
rm -f "$log"
"$VENV/bin/python" -c "import hetplan, torch" # fail loudly if the install did not work
# compile the simulator kernels once (numba caches them on disk; about 40 s on 2 cores)
echo "compiling the simulator kernels (once) ..." >&2
"$VENV/bin/python" -c "from hetplan.algorithms.dp_session import warm_up; warm_up()"
"$VENV/bin/python" -c "from hetplan.algorithms._pipeline_kernel import warm_up; warm_up()"
echo "$want" >"$stamp"
