#!/usr/bin/env bash
# Create or refresh the environments of the real client libraries used by tests/interop (NSQ's,
# and EventMQ's jobmanager and client).
#
#   bash tests/interop/setup_envs.sh            # all clients
#   bash tests/interop/setup_envs.sh gnsq nsqjs # only these
#
# Every Python client gets its own venv under .interop/<client>/ (pynsq and nsq-py both import
# as `nsq`); nsqjs goes to .interop/node/. Everything is installed from PyPI / npm at setup time;
# nothing third-party is kept in the repository. Each env carries a stamp file holding the exact
# requirement list it was built from, so a second run only compares stamps (well under a second).
#
# Needs Python >= 3.11 (`python3`, or INTEROP_PYTHON), node >= 12 and npm. On Debian, when the
# interpreter has no working `venv`/`ensurepip`, the matching pythonX.Y-venv package is installed
# with apt-get (after `apt-get update`), and only then.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
INTEROP_DIR="${INTEROP_DIR:-$ROOT/.interop}"
PYTHON="${INTEROP_PYTHON:-python3}"
STAMP_NAME=".polymq-interop-stamp"
# Bump when the way envs are built changes (forces a rebuild everywhere).
RECIPE_VERSION="1"

# client -> pip requirements (the client pinned as briefed; its runtime deps pinned to versions the
# interop suite was verified with; python-snappy is what the clients `import snappy` for).
declare -A PY_REQS=(
  [pynsq]="pynsq==0.9.1 tornado==6.6.1 python-snappy==0.7.3"
  [gnsq]="gnsq==1.0.2 gevent==26.9.0 urllib3==2.8.0 python-snappy==0.7.3"
  [ansq]="ansq==0.3.0 aiohttp==3.14.5"
  [nsqpy]="nsq-py==0.1.12 requests==2.34.2"
  [asyncnsq]="asyncnsq==1.2.1 aiohttp==3.14.5 python-snappy==0.7.3"
)
# Installed with --no-deps after the env's requirements: EventMQ 0.3.13 pins pyzmq 18 and psutil 5.6,
# which do not build on Python 3.11; it runs on the current ones listed above.
declare -A PY_NODEPS=(
  [eventmq]="eventmq==0.3.13"
)
PY_REQS[eventmq]="pyzmq==27.3.0 future==1.0.0 psutil==7.2.2 croniter==7.0.0 monotonic==1.6 six==1.17.0 python-dateutil==4.0.0 tzdata==2026.6"
PY_CLIENTS=(pynsq gnsq ansq nsqpy asyncnsq eventmq)
NPM_REQS="nsqjs@0.13.0"

log() { printf '[interop-setup] %s\n' "$*" >&2; }

if [ "$#" -gt 0 ]; then
  WANTED=("$@")
else
  WANTED=("${PY_CLIENTS[@]}" nsqjs)
fi
for name in "${WANTED[@]}"; do
  if [ "$name" != nsqjs ] && [ "$name" != node ] && [ -z "${PY_REQS[$name]+x}" ]; then
    log "unknown client '$name' (known: ${PY_CLIENTS[*]} nsqjs)"
    exit 2
  fi
done

mkdir -p "$INTEROP_DIR"
# One setup at a time (pytest and `make test` may both call this).
exec 9>"$INTEROP_DIR/.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

apt_updated=0
apt_install() {
  if ! command -v apt-get >/dev/null 2>&1; then
    log "need Debian package(s) $* but apt-get is not available"
    return 1
  fi
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  if [ "$apt_updated" = 0 ]; then
    log "apt-get update"
    $sudo apt-get update -qq
    apt_updated=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null
}

python_stamp() {
  # Recipe, interpreter version and requirement list: any change rebuilds the env.
  local reqs="$1"
  printf 'recipe=%s\npython=%s\nreqs=%s\n' "$RECIPE_VERSION" \
    "$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')" "$reqs"
}

ensure_venv_support() {
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    log "$PYTHON not found (set INTEROP_PYTHON)"
    exit 1
  fi
  if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    log "$PYTHON is Python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'); the clients need >= 3.11 (set INTEROP_PYTHON)"
    exit 1
  fi
  local probe
  probe="$(mktemp -d)"
  if ! "$PYTHON" -m venv "$probe/v" >/dev/null 2>&1; then
    local ver
    ver="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    log "$PYTHON cannot create a venv; installing python$ver-venv"
    apt_install "python$ver-venv"
  fi
  rm -rf "$probe"
}

build_python_env() {
  local name="$1" reqs="$2" dir="$INTEROP_DIR/$1"
  local logf="$INTEROP_DIR/$name.setup.log"
  local nodeps="${PY_NODEPS[$name]:-}"
  {
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    # shellcheck disable=SC2086
    "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input $reqs
    if [ -n "$nodeps" ]; then
      # shellcheck disable=SC2086
      "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input --no-deps $nodeps
    fi
  } >"$logf" 2>&1 || {
    log "FAILED to build $name env; log follows"
    cat "$logf" >&2
    return 1
  }
  python_stamp "$reqs${nodeps:+ --no-deps $nodeps}" >"$dir/$STAMP_NAME"
  log "$name ready ($reqs)"
}

build_node_env() {
  local dir="$INTEROP_DIR/node" logf="$INTEROP_DIR/node.setup.log"
  {
    rm -rf "$dir"
    mkdir -p "$dir"
    printf '{"name":"polymq-interop-node","private":true,"version":"0.0.0"}\n' >"$dir/package.json"
    (cd "$dir" && npm install --no-audit --no-fund --loglevel=error "$NPM_REQS")
    (cd "$dir" && node -e "require('nsqjs'); require('snappystream')")
  } >"$logf" 2>&1 || {
    log "FAILED to build node env; log follows"
    cat "$logf" >&2
    return 1
  }
  printf 'recipe=%s\nnode=%s\nreqs=%s\n' "$RECIPE_VERSION" "$(node --version)" "$NPM_REQS" >"$dir/$STAMP_NAME"
  log "node ready ($NPM_REQS)"
}

pids=()
names=()
venv_checked=0
for name in "${WANTED[@]}"; do
  if [ "$name" = nsqjs ] || [ "$name" = node ]; then
    if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
      log "node and npm are required for nsqjs"
      exit 1
    fi
    want="$(printf 'recipe=%s\nnode=%s\nreqs=%s\n' "$RECIPE_VERSION" "$(node --version)" "$NPM_REQS")"
    if [ -f "$INTEROP_DIR/node/$STAMP_NAME" ] && [ "$(cat "$INTEROP_DIR/node/$STAMP_NAME")" = "$want" ] \
        && [ -d "$INTEROP_DIR/node/node_modules/nsqjs" ]; then
      continue
    fi
    build_node_env &
    pids+=("$!")
    names+=(node)
    continue
  fi
  reqs="${PY_REQS[$name]}${PY_NODEPS[$name]:+ --no-deps ${PY_NODEPS[$name]}}"
  dir="$INTEROP_DIR/$name"
  if [ -x "$dir/bin/python" ] && [ -f "$dir/$STAMP_NAME" ] \
      && [ "$(cat "$dir/$STAMP_NAME")" = "$(python_stamp "$reqs")" ]; then
    continue
  fi
  if [ "$venv_checked" = 0 ]; then
    ensure_venv_support
    venv_checked=1
  fi
  build_python_env "$name" "${PY_REQS[$name]}" &
  pids+=("$!")
  names+=("$name")
done

status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    log "setup of ${names[$i]} failed"
    status=1
  fi
done
exit "$status"
