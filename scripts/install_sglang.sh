#!/usr/bin/env bash
# Install one sglang release as an allocator target for kv-lockstep.
#
#   scripts/install_sglang.sh 0.5.23
#
# Phase 1: the import-time dependency set (constraints/sglang.txt) goes into the
#          repo venv .venv, once; .venv/.sglang-deps records the constraints hash.
# Phase 2: the sglang wheel is fetched (--no-deps) into .sglang/wheels/, or reused.
# Phase 3: the wheel is unpacked with `pip install --no-deps --target .sglang/V`;
#          .sglang/V/.kv-lockstep-wheel records which wheel it came from.
# Phase 4 (only when phase 1 or 3 did work): an import check of the allocators.
# A second run with nothing changed does no pip work.
set -euo pipefail

V="${1:-}"
if [[ -z "$V" ]]; then
    echo "usage: $0 VERSION   (e.g. $0 0.5.23)" >&2
    exit 2
fi
if [[ ! "$V" =~ ^[0-9A-Za-z.+_-]+$ ]]; then
    echo "install_sglang: odd version string '$V'" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV=.venv
PY="$VENV/bin/python"
CONSTRAINTS=constraints/sglang.txt
DEPS_STAMP="$VENV/.sglang-deps"
WHEELS=.sglang/wheels
TARGET=".sglang/$V"
TARGET_STAMP="$TARGET/.kv-lockstep-wheel"

if [[ ! -x "$PY" ]]; then
    echo "install_sglang: $PY not found; run \`make install\` first" >&2
    exit 1
fi

pip_q() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
did_work=0

# --- phase 1: dependency set --------------------------------------------------
want_hash="$(sha256sum "$CONSTRAINTS" | cut -d' ' -f1)"
have_hash="$(cat "$DEPS_STAMP" 2>/dev/null || true)"
if [[ "$want_hash" == "$have_hash" ]]; then
    echo "[1/3] deps: up to date ($CONSTRAINTS ${want_hash:0:12})"
else
    echo "[1/3] deps: installing $CONSTRAINTS into $VENV ..."
    t0=$SECONDS
    pip_q install -r "$CONSTRAINTS" -c "$CONSTRAINTS"
    echo "$want_hash" >"$DEPS_STAMP"
    echo "[1/3] deps: installed in $((SECONDS - t0))s"
    did_work=1
fi

# --- phase 2: wheel -----------------------------------------------------------
mkdir -p "$WHEELS"
find_wheel() {
    local w
    for w in "$WHEELS"/sglang-"$V"-*.whl; do
        [[ -f "$w" ]] && { echo "$w"; return 0; }
    done
    return 1
}
if wheel="$(find_wheel)"; then
    echo "[2/3] wheel: cached $wheel"
else
    echo "[2/3] wheel: downloading sglang==$V (no deps) into $WHEELS ..."
    pip_q download --no-deps "sglang==$V" -d "$WHEELS"
    wheel="$(find_wheel)" || {
        echo "install_sglang: pip download produced no sglang-$V wheel in $WHEELS" >&2
        exit 1
    }
    echo "[2/3] wheel: downloaded $wheel"
fi

# --- phase 3: unpack into .sglang/V -------------------------------------------
wheel_id="$(basename "$wheel") $(sha256sum "$wheel" | cut -d' ' -f1)"
if [[ -d "$TARGET/sglang" && "$(cat "$TARGET_STAMP" 2>/dev/null || true)" == "$wheel_id" ]]; then
    echo "[3/3] target: up to date ($TARGET)"
else
    echo "[3/3] target: installing $(basename "$wheel") into $TARGET ..."
    tmp="$TARGET.tmp.$$"
    rm -rf "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    pip_q install --no-deps --no-compile --target "$tmp" "$wheel"
    echo "$wheel_id" >"$tmp/.kv-lockstep-wheel"
    rm -rf "$TARGET"
    mv "$tmp" "$TARGET"
    trap - EXIT
    echo "[3/3] target: installed $TARGET"
    did_work=1
fi

# --- import check, only after changes -----------------------------------------
# kv-lockstep's own loader: it reads the release's allocator layout (a package
# or one allocator.py) and names a package the import set lacks, in one line.
if [[ "$did_work" == 1 ]]; then
    echo "[check] importing sglang allocators from $TARGET ..."
    if ! PYTHONPATH="$ROOT" "$PY" -W ignore -c '
import sys
from state_machines.targets import TargetError, sglang
try:
    info = sglang.load_sglang(sys.argv[1])
except TargetError as exc:
    sys.exit(f"[check] failed: {exc}")
import torch
print("[check] ok: sglang", info.version, "(" + info.layout + " layout), torch", torch.__version__)
for kind, why in info.unavailable.items():
    print(f"[check] {kind}: unavailable: {why}")
' "$TARGET" 2>&1 | grep -E '^\[check\]'; then
        echo "install_sglang: import check failed for $TARGET" >&2
        exit 1
    fi
fi
