#!/usr/bin/env bash
# One entry point that sets everything up itself on a fresh machine with Python >= 3.10:
#   ./run.sh demo [ARGS]   the main job (bigper demo)
#   ./run.sh test [ARGS]   the test suite (pytest, on 3 workers: a third fills the time the
#                          others wait on children, kills and disks; 10.3 min, not 12.3, on 2 cores)
#   ./run.sh bigper ARGS   any bigper command (bench, info, verify, ...)
#   ./run.sh docs          the documentation site into docs/_build/html (warnings are errors),
#                          its local links checked, and the public API's types (pyright --verifytypes)
# It creates or reuses .venv beside this file and installs what the command needs.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${BIGPER_VENV:-$here/.venv}"
py="${PYTHON:-python3}"
cmd="${1:-}"; shift || true

if [ ! -x "$venv/bin/python" ]; then
  echo "run.sh: creating $venv" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)

install() {  # $1: the extras; skipped when they were installed already from this pyproject.toml
  local stamp="$venv/.bigper-installed" want have x missing=""
  want="$(sha256sum < "$here/pyproject.toml" | cut -c1-16)"
  have=""
  if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ]; then have="$(tail -n +2 "$stamp")"; fi
  for x in ${1//,/ }; do grep -qx "$x" <<<"$have" || missing="$missing $x"; done
  [ -z "$missing" ] && return
  # The union of what was installed and what is asked: one install serves every mode after it.
  local all; all="$(printf '%s\n' $have ${1//,/ } | sort -u | paste -sd, -)"
  # A CPU build of torch first, so that torch>=2.1 is already satisfied and no
  # multi-GB CUDA build is pulled in (torchrl and tensordict then keep it: they ask for torch>=2.1).
  if grep -qxE 'torch|torchrl' <<<"${all//,/$'\n'}"; then
    "$venv/bin/python" -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
  fi
  "${pip[@]}" -e "$here[$all]"
  { echo "$want"; tr ',' '\n' <<<"$all"; } > "$stamp"
}

case "$cmd" in
  demo)   install "torch,atari";         exec "$venv/bin/bigper" demo "$@" ;;
  # two pytest-xdist workers, each test file whole on one (tests/conftest.py); -n 0 after it: one process
  test)   install "torch,atari,ray,dev,compression,torchrl,jax";  cd "$here"
          exec "$venv/bin/python" -m pytest -n 3 --dist loadfile "$@" ;;
  # what each command needs, no more: --help, info, verify, convert, reprioritize run on the core (zstd
  # for compressed files); bench needs the peers it measures and torch; demo what the demo needs
  bigper) case "${1:-}" in
            bench) install "torch,atari,dev,compression" ;;
            demo)  install "torch,atari" ;;
            *)     install "compression" ;;
          esac
          exec "$venv/bin/bigper" "$@" ;;
  docs)   install "torch,atari,ray,sb3,sb3-contrib,docs"; cd "$here"
          rm -rf docs/_build
          "$venv/bin/python" -m sphinx -E -W --keep-going -n -b html docs docs/_build/html "$@"
          "$venv/bin/python" tools/dev/check_site.py docs/_build/html
          exec "$venv/bin/python" tools/dev/verify_types.py ;;
  *) echo "usage: ./run.sh demo|test|bigper|docs [ARGS...]" >&2; exit 2 ;;
esac
