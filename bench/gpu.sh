#!/usr/bin/env bash
# bench/gpu.sh: the rollout and AR-decode benchmarks on a CUDA GPU, in one prepared run.
#
# Usage:
#   bash bench/gpu.sh --prepare           # here, where PyPI is reachable: wheels into .whl/
#   bash bench/gpu.sh                     # on the GPU machine (<= 8 minutes, install included)
#   bash bench/gpu.sh --allow-cpu --quick # a dry run on a CPU (tiny checkpoint, < 2 minutes)
#
# On the lent GPU machine (no package index; python3 there has a CUDA torch), after --prepare:
#   device run: command "bash bench/gpu.sh", carry [".whl"], timeout_s 540
#
# What it does: picks a python whose torch sees CUDA ($PYTHON, else .venv/bin/python, else
# python3; none: exit 3 with the reason, unless --allow-cpu, which runs on the CPU; no torch
# anywhere: creates .venv with `pip install -e '.[chattts]'` and the einops and numba the
# benchmarks import, which needs an index), installs
# what the benchmarks lack (bench/gpu_support.py: the carried wheels in .whl/, else the index)
# into a folder on PYTHONPATH, prints nvidia-smi and the torch/CUDA versions, writes the
# full-size ChatTTS checkpoint (random weights, /tmp), then runs, each under a time limit:
#   bench/ar_decode.py --device cuda --concurrency 1,16 --tokens 96 --rounds 2
#   bench/rollout.py   --device cuda --inputs 2 --n 8 --tokens 96 --update-reps 3
# (--quick: the servable tiny checkpoint, 8 tokens, C = 1,2, 2 x 2 samples, 1 round).
# Results in $OUT (the device tool's folder), else bench/results/gpu/: ar_decode.json and
# rollout.json (every figure), gpu_summary.txt and gpu_summary.json (the headline figures and
# each step's status), gpu.log (everything printed). Exit status: 0 when both benchmarks wrote
# their JSON, 1 when one failed or ran out of time, 2 bad usage, 3 no CUDA, 4 packages missing.
# Never part of the tests' requirements (tests/test_bench_gpu.py runs the --allow-cpu --quick
# path).

set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 2

ALLOW_CPU=0
QUICK=0
PREPARE=0
for arg in "$@"; do
    case "$arg" in
        --allow-cpu) ALLOW_CPU=1 ;;
        --quick) QUICK=1 ;;
        --prepare) PREPARE=1 ;;
        -h | --help)
            sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
            exit 0
            ;;
        *)
            echo "gpu.sh: unknown option '$arg' (see --help)" >&2
            exit 2
            ;;
    esac
done

WHEELS="${GPU_WHEELS:-$REPO/.whl}"
SITE="${GPU_SITE:-/tmp/omnistep-bench-site}"
OUT_DIR="${OUT:-$REPO/bench/results/gpu}"

candidates() {
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
        return
    fi
    [ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python"
    command -v python3 || true
}

torch_line() { # what a python's torch is, in one line
    "$1" -c 'import torch; print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, sees a GPU: {torch.cuda.is_available()}")' 2>/dev/null || echo "no torch"
}

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }

prepare() {
    local py=""
    for c in $(candidates); do
        if "$c" -m pip --version >/dev/null 2>&1; then
            py="$c"
            break
        fi
    done
    [ -n "$py" ] || { echo "gpu.sh --prepare: no python with pip here (set PYTHON)" >&2; return 2; }
    # .whl/ is git-ignored (.gitignore), so it travels to the device only when carried
    "$py" bench/gpu_support.py prepare "$WHEELS" --python-version "${WHEEL_PYTHON:-3.12}" || return 4
    echo "next, on the GPU machine: command 'bash bench/gpu.sh', carry ['.whl'], timeout_s 540"
}

run_step() { # NAME LIMIT_S COMMAND...: runs it under a time limit, records its exit status
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name (limit ${limit}s) $(date +%T)"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    STEPS+=("$name=$rc")
    return $rc
}

main() {
    echo "gpu.sh $* on ${HOSTNAME:-this machine} at $(date -u +%FT%TZ), $(nproc) cores, repo $REPO"
    local py="" device=cpu c
    for c in $(candidates); do
        if has_cuda "$c"; then
            py="$c"
            device=cuda
            break
        fi
    done
    if [ -z "$py" ]; then
        for c in $(candidates); do has_torch "$c" && { py="$c"; break; }; done
        if [ -z "$py" ]; then
            echo "no python here has torch: creating .venv (pip install -e '.[chattts]', needs an index)"
            local specs
            specs="$(python3 bench/gpu_support.py venv-specs)" || return 4
            # shellcheck disable=SC2086 # one requirement per word
            if ! { python3 -m venv "$REPO/.venv" &&
                "$REPO/.venv/bin/pip" install -q -e "${REPO}[chattts]" $specs; }; then
                echo "gpu.sh: could not create .venv with torch" >&2
                return 4
            fi
            py="$REPO/.venv/bin/python"
            has_cuda "$py" && device=cuda
        fi
    fi
    if [ "$device" != cuda ] && [ "$ALLOW_CPU" = 0 ]; then
        echo "gpu.sh: CUDA is not available, so there is nothing to benchmark here." >&2
        for c in $(candidates); do echo "  $c: $(torch_line "$c")" >&2; done
        echo "  (pass --allow-cpu for a dry run on the CPU)" >&2
        return 3
    fi
    echo "python: $py ($(torch_line "$py")); benchmarks on $device"

    export PYTHONUNBUFFERED=1
    export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
    "$py" bench/gpu_support.py install "$WHEELS" "$SITE" || {
        echo "gpu.sh: packages are missing (on a machine without an index, run" \
            "'bash bench/gpu.sh --prepare' where PyPI is reachable and carry .whl)" >&2
        return 4
    }

    if [ "$device" = cuda ]; then
        command -v nvidia-smi >/dev/null && nvidia-smi
        "$py" -c 'import torch; p = torch.cuda.get_device_properties(0); print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")'
    else
        "$py" -c 'import torch; print(f"torch {torch.__version__} (CPU), {torch.get_num_threads()} threads")'
    fi
    "$py" -c 'import sys, numpy, transformers; print(f"python {sys.version.split()[0]}, numpy {numpy.__version__}, transformers {transformers.__version__}")'

    local size threads ar_args ro_args ckpt_s ar_s ro_s
    if [ "$QUICK" = 1 ]; then
        size=tiny
        ar_args=(--concurrency "1,2" --tokens 8 --rounds 1)
        ro_args=(--inputs 2 --n 2 --tokens 8 --update-reps 1)
        ckpt_s=120 ar_s=240 ro_s=180
    else
        size=full
        ar_args=(--concurrency "1,16" --tokens 96 --rounds 2)
        ro_args=(--inputs 2 --n 8 --tokens 96 --update-reps 3)
        ckpt_s=60 ar_s=230 ro_s=160 # 450 s with ~15 s of setup: inside 8 minutes
    fi
    if [ "$device" = cuda ]; then
        threads=$(($(nproc) < 8 ? $(nproc) : 8))
    else
        threads=$((QUICK ? 1 : 2))
    fi

    mkdir -p "$OUT_DIR"
    rm -f "$OUT_DIR/ar_decode.json" "$OUT_DIR/rollout.json" # no stale figures
    STEPS=()
    run_step checkpoint "$ckpt_s" "$py" -c "import sys; sys.path.insert(0, 'bench'); import ar_decode as a; print(a.ensure_checkpoint(a.SIZES['$size'][1], '$size'))"
    run_step ar_decode "$ar_s" "$py" bench/ar_decode.py --device "$device" --size "$size" \
        --threads "$threads" "${ar_args[@]}" --out "$OUT_DIR/ar_decode.json"
    local ar_rc=$?
    run_step rollout "$ro_s" "$py" bench/rollout.py --device "$device" --size "$size" \
        --threads "$threads" "${ro_args[@]}" --out "$OUT_DIR/rollout.json"
    local ro_rc=$?
    [ "$device" = cuda ] && command -v nvidia-smi >/dev/null &&
        nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv

    echo
    echo "=== summary ($OUT_DIR/gpu_summary.txt)"
    "$py" bench/gpu_support.py summary "$OUT_DIR" --steps "${STEPS[@]}"
    echo "gpu.sh took ${SECONDS}s"
    [ "$ar_rc" = 0 ] && [ "$ro_rc" = 0 ]
}

if [ "$PREPARE" = 1 ]; then
    prepare
    exit $?
fi
mkdir -p "$OUT_DIR" || exit 2
main "$@" 2>&1 | tee "$OUT_DIR/gpu.log"
status=${PIPESTATUS[0]}
case "$status" in
    0) ;;
    1) echo "gpu.sh: exit 1: a benchmark failed or ran out of time (see $OUT_DIR/gpu.log)" >&2 ;;
    3) echo "gpu.sh: exit 3: CUDA is not available (--allow-cpu for a dry run on the CPU)" >&2 ;;
    4) echo "gpu.sh: exit 4: packages are missing (see $OUT_DIR/gpu.log)" >&2 ;;
    *) echo "gpu.sh: exit $status (see $OUT_DIR/gpu.log)" >&2 ;;
esac
exit "$status"
