#!/usr/bin/env bash
# GPU readiness in one short call (< 8 minutes on one H200; installs nothing from the network).
#
#   bash bench/gpu_check.sh                          # on a machine with an NVIDIA GPU
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh --smoke   # dry run on a CPU (< 60 s, 2 cores)
#   bash bench/gpu_check.sh --only=greedy,math       # a subset (env always runs):
#                                                    # greedy, math-cpu, math, bench
#
# Steps, each timed, each with its own PASS / FAIL / SKIP line (driver: bench/gpu_check.py;
# the steps in bench/gpu_env.py, bench/gpu_greedy.py, bench/gpu_math.py):
#   0 env      which python, torch and CUDA it found; whether the stack's modules import
#              (exit 2 at once when the device is cuda and torch has no CUDA)
#   1 greedy   the real stack (Redis, draft + target workers on --device, coordinator) against
#              Hugging Face generate(do_sample=False) on the same device, same dtype, γ 2 and 4,
#              once per dtype in GPU_CHECK_DTYPES (default "float32 bfloat16")
#   2 math     a) python -m bench.math --quick on the CPU (it has no --device option: TODO;
#                 --only name math-cpu)
#              b) bench/math.py's hot path (propose_step, verify_logits) on the device, checked
#                 against the CPU and timed (--only name math)
#   3 bench    python -m bench.run --pair smollm2 --quick --device D --dtype T: the workers,
#              the HF peers and the per-token costs on the device
# --smoke: the code pair (models/target, models/draft), float32, 2 prompts x 16 tokens; step 2
# as one tiny run of both parts (vocabulary 512, batches 1 and 4); step 3 skipped.
# Last line: `gpu_check: N passed, M failed, K skipped (T s)`; exit 0 only if nothing failed
# (2 when CUDA was asked for and torch has none).
#
# A machine without network: bench/gpu_bundle.sh packs the wheels, SmolLM2 and its draft here
# and unpacks them there (see its header).
#
# Environment: OUT (default results/gpu_check), GPU_CHECK_DEVICE (cuda), GPU_CHECK_DTYPES,
# GPU_CHECK_BUDGET_S (450; smoke 300), GPU_CHECK_PROMPTS, GPU_CHECK_MAX_NEW_TOKENS,
# GPU_CHECK_PAIR (auto | smollm2 | code), GPU_CHECK_MATH_VOCABS, GPU_CHECK_MATH_BATCHES,
# GPU_CHECK_BENCH_PAIR, GPU_CHECK_BENCH_DTYPE (float32), GPU_CHECK_BENCH_ARGS (extra flags),
# GPU_CHECK_WHEELS (.whl: wheels installed offline first, if any), GPU_CHECK_PACK=1 (pack
# everything under $OUT into one tar.gz, keeping only it, the log and the summary: a device
# machine returns at most 8 files), GPU_CHECK_PERTURB_REFERENCE=1 (negative control: step 1
# must FAIL). The workers inherit SPECDEC_* flags: SPECDEC_BATCH_ATTENTION=sessions runs steps 1
# and 3 with attention over each session's own KV on the GPU (auto keeps the padded batch copy
# on CUDA: compare both before changing that default).
set -u
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
SMOKE=0
ONLY=""
for arg in "$@"; do
    case "$arg" in
        --smoke) SMOKE=1 ;;
        --only=*) ONLY=${arg#--only=} ;;
        -h | --help)
            awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
            exit 0
            ;;
        *)
            echo "gpu_check: unknown argument $arg (see --help)" >&2
            exit 2
            ;;
    esac
done

DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT/logs" || exit 2
rm -f "$OUT"/logs/*.log
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
T0=$SECONDS

# One thread per process, no network, unbuffered output; the repository importable.
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMEXPR_NUM_THREADS=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys' >/dev/null 2>&1; then
    PY="$ROOT/.venv/bin/python"
    WHY="the repository's .venv"
else
    PY=$(command -v python3 || true)
    WHY="python3 on PATH (no usable .venv/bin/python)"
fi
if [ -z "$PY" ]; then
    echo "gpu_check: neither .venv/bin/python nor python3 found"
    exit 2
fi
echo "gpu_check: python $PY ($WHY); device $DEVICE; smoke $SMOKE; out $OUT"

WHEELS=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=/tmp/gpu_check_site
    echo "gpu_check: installing $(ls "$WHEELS"/*.whl | wc -l) carried wheel(s) from $WHEELS offline into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || echo "gpu_check: offline wheel install failed"
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
fi

if [ "$SMOKE" = 1 ]; then
    BUDGET=${GPU_CHECK_BUDGET_S:-300}
    DTYPES=${GPU_CHECK_DTYPES:-float32}
    PAIR=${GPU_CHECK_PAIR:-code}
    PROMPTS=${GPU_CHECK_PROMPTS:-2}
    NEW_TOKENS=${GPU_CHECK_MAX_NEW_TOKENS:-16}
else
    BUDGET=${GPU_CHECK_BUDGET_S:-450}
    DTYPES=${GPU_CHECK_DTYPES:-float32 bfloat16}
    PAIR=${GPU_CHECK_PAIR:-auto}
    PROMPTS=${GPU_CHECK_PROMPTS:-4}
    NEW_TOKENS=${GPU_CHECK_MAX_NEW_TOKENS:-32}
fi

PASSED=0
FAILED=0
SKIPPED=0
LINES=()

wanted() { # wanted STEP: is it among --only (all when --only is not given)?
    [ -z "$ONLY" ] && return 0
    case ",$ONLY," in *",$1,"*) return 0 ;; esac
    return 1
}

record() { # record STATUS NAME SECONDS DETAIL
    local line
    line=$(printf '%-4s  %-22s %6s  %s' "$1" "$2" "$3" "$4")
    LINES+=("$line")
    echo "$line"
    case "$1" in
        PASS) PASSED=$((PASSED + 1)) ;;
        FAIL) FAILED=$((FAILED + 1)) ;;
        SKIP) SKIPPED=$((SKIPPED + 1)) ;;
    esac
}

LAST_RC=0
step() { # step NAME LIMIT_S COMMAND...: run it under the remaining budget, record its line
    local name=$1 limit=$2 left start rc detail steplog
    shift 2
    left=$((BUDGET - (SECONDS - T0)))
    if [ "$left" -lt 20 ]; then
        record FAIL "$name" "-" "not run: ${BUDGET} s budget spent (GPU_CHECK_BUDGET_S)"
        LAST_RC=124
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        record FAIL "$name" "-" "not run: ${limit} s left of the ${BUDGET} s budget"
        LAST_RC=124
        return
    fi
    steplog="$OUT/logs/$name.log"
    echo
    echo "---- $name (limit ${limit} s): $*"
    start=$SECONDS
    # SIGINT, not SIGTERM, at the limit: Python unwinds, so a stack's children are stopped
    timeout -s INT -k 30 "$limit" "$@" 2>&1 | tee "$steplog"
    rc=${PIPESTATUS[0]}
    LAST_RC=$rc
    detail=$(grep '^RESULT ' "$steplog" | tail -n 1 | sed 's/^RESULT \(PASS\|FAIL\) //')
    if [ "$rc" = 0 ]; then
        record PASS "$name" "$((SECONDS - start)) s" "${detail:-exit 0}"
    elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        record FAIL "$name" "$((SECONDS - start)) s" "timed out after ${limit} s; log $steplog"
    else
        record FAIL "$name" "$((SECONDS - start)) s" "${detail:-exit $rc; log $steplog}"
    fi
}

finish() {
    local code=$1
    echo
    echo "==== summary ($DEVICE, python $PY)"
    printf '%s\n' "${LINES[@]}"
    {
        printf '%s\n' "${LINES[@]}"
        echo "gpu_check: $PASSED passed, $FAILED failed, $SKIPPED skipped ($((SECONDS - T0)) s)"
    } >"$OUT/summary.txt"
    if [ "${GPU_CHECK_PACK:-0}" = 1 ]; then
        tar -czf /tmp/gpu_check_all.tar.gz -C "$OUT" --exclude=gpu_check.log . &&
            find "$OUT" -mindepth 1 -maxdepth 1 ! -name gpu_check.log ! -name summary.txt \
                -exec rm -rf {} + &&
            mv /tmp/gpu_check_all.tar.gz "$OUT/gpu_check_all.tar.gz"
    fi
    echo "gpu_check: $PASSED passed, $FAILED failed, $SKIPPED skipped ($((SECONDS - T0)) s)"
    exit "$code"
}

# ---- 0: the environment --------------------------------------------------------------
step 0-env 90 "$PY" -m bench.gpu_check env --device "$DEVICE" --out "$OUT"
ENV_RC=$LAST_RC
if [ "$ENV_RC" = 2 ]; then
    echo "gpu_check: torch at $PY has no CUDA for --device $DEVICE; nothing else runs"
    finish 2
fi
STACK_OK=1
[ "$ENV_RC" = 0 ] || STACK_OK=0

# ---- 1: greedy equality with Hugging Face, on the device -------------------------------
for dtype in $DTYPES; do
    wanted greedy || break
    if [ "$STACK_OK" = 0 ]; then
        record FAIL "1-greedy-$dtype" "-" "not run: the stack cannot start (see 0-env)"
        continue
    fi
    step "1-greedy-$dtype" 180 "$PY" -m bench.gpu_check greedy --device "$DEVICE" \
        --dtype "$dtype" --pair "$PAIR" --gammas 2,4 --prompts "$PROMPTS" \
        --max-new-tokens "$NEW_TOKENS" --out "$OUT"
done

# ---- 2: the math micro-benchmark -------------------------------------------------------
if wanted math || wanted math-cpu; then
    if [ "$SMOKE" = 1 ]; then
        # one process (torch imports once): bench.math's own cases, then the hot path on
        # the device against the CPU, at a 512-token vocabulary and batches 1 and 4
        step "2-math-$DEVICE" 60 "$PY" -m bench.gpu_check math --device "$DEVICE" \
            --vocabs 512 --batches 1,4 --repeat 2 --bench-cases --out "$OUT"
    else
        # TODO(bench.math --device): bench/math.py builds every tensor on the CPU and has no
        # device option, so this times the CPU (1 thread, --quick); 2b runs its hot path on
        # the device. Once it has `--device`, add: --device "$DEVICE" (and drop 2b's timing).
        if wanted math-cpu; then
            echo "TODO: bench.math has no --device option; 2a runs it on the CPU (--quick)"
            step 2a-bench-math-cpu 120 "$PY" -m bench.gpu_check bench-math --out "$OUT/math" \
                -- --quick --threads 1
        fi
        if wanted math; then
            step "2b-math-$DEVICE" 150 "$PY" -m bench.gpu_check math --device "$DEVICE" \
                --vocabs "${GPU_CHECK_MATH_VOCABS:-8192,49152,128256,262144}" \
                --batches "${GPU_CHECK_MATH_BATCHES:-1,16,64}" --out "$OUT"
        fi
    fi
fi

# ---- 3: the benchmark on the real pair -------------------------------------------------
if wanted bench; then
    if [ "$SMOKE" = 1 ]; then
        record SKIP 3-bench-run "-" "smoke mode: python -m bench.run --quick takes minutes"
    elif [ "$STACK_OK" = 0 ]; then
        record FAIL 3-bench-run "-" "not run: the stack cannot start (see 0-env)"
    else
        BENCH_PAIR=${GPU_CHECK_BENCH_PAIR:-$("$PY" -m bench.gpu_check pair --pair auto)}
        if [ -z "${GPU_CHECK_BENCH_PAIR:-}" ] && [ "$BENCH_PAIR" != smollm2 ]; then
            echo "NOTE: SmolLM2 is not converted here: bench.run runs --pair $BENCH_PAIR"
        fi
        # python -m bench.run --pair P --quick --threads 2 --device D --dtype T --out
        # $OUT/bench: every contender on the device; whatever the budget leaves, less 15 s
        # for the summary.
        # GPU_CHECK_BENCH_ARGS adds flags (e.g. "--prompts 2" where the budget is short).
        # shellcheck disable=SC2086
        step 3-bench-run $((BUDGET - (SECONDS - T0) - 15)) "$PY" -m bench.gpu_check bench \
            --device "$DEVICE" --dtype "${GPU_CHECK_BENCH_DTYPE:-float32}" --pair "$BENCH_PAIR" \
            --out "$OUT/bench" -- ${GPU_CHECK_BENCH_ARGS:-}
    fi
fi

if [ "$FAILED" -gt 0 ]; then finish 1; else finish 0; fi
