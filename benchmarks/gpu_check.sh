#!/usr/bin/env bash
# The GPU check: one prepared script for a lent GPU machine with no network (its python3 has torch, jax,
# onnxruntime's CPU build, pandas, scipy; the rest comes from `make gpu-wheels`' folder .whl/, and the graphs to
# calibrate from `python benchmarks/gpu_calibrate.py --pack .gpu/cal_pack`, both made here beforehand).
#
#   bash benchmarks/gpu_check.sh [--parts env,tests,calibrate,agents,pipeline,evaluate] [--out DIR] [--dry-run]
#
# Parts, in this order (the timing-sensitive ones first, while nothing else runs):
#   env        versions, nvidia-smi; installs .whl/ into a private site folder (always run)
#   calibrate  whole-model runs of the packed graphs on the GPU, per node (benchmarks/gpu_calibrate.py)
#   agents     the model-free agent's PPO updates on cuda and cpu, threads varied (benchmarks/agent_device.py)
#   pipeline   the tiny pipeline with device: cuda through snakemake (rule all), then dvc status, dvc repro and
#              dvc repro --force of its two GPU-heaviest stages
#   evaluate   evaluate on paper-size bert with torch on the GPU (beside pipeline: read its timings with care)
#   tests      the tests marked gpu (pytest -m gpu), beside pipeline and evaluate
#   fused      (only when named: about 5 minutes alone) fused attention against TASO on paper-size bert, vit and
#              gpt2, torch on the GPU, op by op, with the protocol (benchmarks/fused_protocol.py --device cuda)
#   stages     (only when named: 5-7 minutes alone) the default config's learning stages for bert through
#              snakemake with device: cuda, side by side as rule all runs them: their wall times and the agents'
#              phases (benchmarks/gpu_pipeline.py --parts stages; the same with --device cpu on the CPU box)
# Writes DIR/gpu_check.json (each part's exit code and seconds; the files each part wrote) and DIR/gpu_check.log.
# onnxruntime-gpu and TensorFlow do not fit in the 64 MiB a call may carry: their rows are "not run" there.
# --dry-run checks the wheel folder against envs/gpu-check-wheels.txt, the pack and each part's command, and
# prints the commands without running them.
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS="env,tests,calibrate,agents,pipeline,evaluate"
OUTDIR="${OUT:-gpu_check_out}"
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --parts) PARTS="env,$2"; shift 2 ;;
    --out) OUTDIR="$2"; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
WHL="${GPU_CHECK_WHEELS:-.whl}"  # the wheel folder (make gpu-wheels)
SITE="${GPU_CHECK_SITE:-/tmp/gpu-check-site}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
JSON="$OUTDIR/gpu_check.json"
: > "$LOG"
RESULTS=()
has() { case ",$PARTS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
say() { echo "gpu_check: $*" | tee -a "$LOG"; }

# part NAME COMMAND...: run (or, with --dry-run, print) one part; its exit code and seconds go to the JSON
part() {
  local name="$1"; shift
  if [ "$DRY" = 1 ]; then say "would run [$name]: $*"; return 0; fi
  say "[$name] $*"
  local t0=$SECONDS
  "$@" >> "$LOG" 2>&1
  local rc=$?
  say "[$name] exit $rc in $((SECONDS - t0)) s"
  RESULTS+=("\"$name\": {\"exit_code\": $rc, \"seconds\": $((SECONDS - t0))}")
}

check_wheels() {  # every pin of envs/gpu-check-wheels.txt has exactly one wheel in .whl/, and nothing else is there
  "$PY" - <<'EOF'
import os, re, sys
from pathlib import Path
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
pins = {}
for line in Path("envs/gpu-check-wheels.txt").read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        pins[norm(name)] = version
have = {}
for w in Path(os.environ.get("GPU_CHECK_WHEELS", ".whl")).glob("*.whl"):
    name, version = w.name.split("-")[:2]
    have.setdefault(norm(name), []).append(version)
bad = [f"{n}=={v}: missing" for n, v in pins.items() if n not in have]
bad += [f"{n}: {vs} in the wheel folder, pinned {pins.get(n)}" for n, vs in have.items() if vs != [pins.get(n)]]
if bad:
    sys.exit("gpu_check: the wheel folder does not match envs/gpu-check-wheels.txt (run make gpu-wheels): "
             + "; ".join(bad))
print(f"gpu_check: the wheel folder holds the {len(pins)} pinned wheels")
EOF
}

# ---- env
if [ ! -d "$WHL" ]; then echo "gpu_check: no $WHL/ folder: run make gpu-wheels here first" >&2; exit 2; fi
check_wheels 2>&1 | tee -a "$LOG"; [ "${PIPESTATUS[0]}" = 0 ] || exit 2
if has calibrate && [ ! -d .gpu/cal_pack ]; then
  echo "gpu_check: no .gpu/cal_pack: run python benchmarks/gpu_calibrate.py --pack .gpu/cal_pack here first" >&2
  exit 2
fi
if [ "$DRY" = 0 ]; then
  rm -rf "$SITE" && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHL"/*.whl >> "$LOG" 2>&1 || { say "installing .whl/ failed (see the log)"; exit 2; }
  export PYTHONPATH="$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PY" -c "import torch, onnxruntime, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', \
'onnxruntime', onnxruntime.__version__, onnxruntime.get_available_providers())"
    "$PY" -c "import tensorflow" 2>/dev/null && echo "tensorflow present" || echo "tensorflow: not installed (rows not run)"
  } 2>&1 | tee -a "$LOG" > "$OUTDIR/env.txt"
fi
if [ "$DRY" = 1 ]; then
  for s in gpu_calibrate agent_device gpu_pipeline fused_protocol; do
    "$PY" "benchmarks/$s.py" --help > /dev/null || { echo "gpu_check: benchmarks/$s.py --help failed" >&2; exit 2; }
  done
fi

# ---- timing-sensitive parts, one at a time
has calibrate && part calibrate "$PY" benchmarks/gpu_calibrate.py --from .gpu/cal_pack --out "$OUTDIR/calibration.json" \
  --runs 5 --rounds 6 --sessions 4 --budget 1 --limit 110
has fused && part fused "$PY" benchmarks/fused_protocol.py --device cuda --models bert vit gpt2 --methods greedy \
  --budget-s 20 --rounds 5
has stages && part stages "$PY" benchmarks/gpu_pipeline.py --parts stages --together --device cuda --limit 480 \
  --out "$OUTDIR/stages.json" --keep /tmp/gpu-stages
has agents && part agents "$PY" benchmarks/agent_device.py --devices cuda,cpu --updates 3 --limit 120 \
  --out "$OUTDIR/agent_device.json"

# ---- the pipeline, evaluate and the tests side by side
PIDS=()
if has pipeline; then
  part pipeline "$PY" benchmarks/gpu_pipeline.py --parts pipeline --limit 300 --out "$OUTDIR/gpu_pipeline.json" \
    --keep /tmp/gpu-pipeline &
  PIDS+=($!)
fi
if has evaluate; then
  part evaluate "$PY" benchmarks/gpu_pipeline.py --parts evaluate --budget 3 --out "$OUTDIR/gpu_evaluate.json" \
    --keep /tmp/gpu-evaluate &
  PIDS+=($!)
fi
if has tests; then
  part tests "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py tests/test_cost.py \
    tests/test_platform.py --junitxml "$OUTDIR/tests.xml" &
  PIDS+=($!)
fi
for p in "${PIDS[@]}"; do wait "$p"; done
# (parts run in the background append to RESULTS in their own shell: read their exit codes back from the log)
if [ "$DRY" = 0 ]; then
  "$PY" - "$LOG" "$JSON" <<'EOF'
import json, re, sys
log, out = sys.argv[1:]
parts = {m[0]: {"exit_code": int(m[1]), "seconds": int(m[2])}
         for m in re.findall(r"gpu_check: \[(\w+)\] exit (\d+) in (\d+) s", open(log).read())}
json.dump({"parts": parts}, open(out, "w"), indent=1)
print("gpu_check:", ", ".join(f"{k} exit {v['exit_code']} ({v['seconds']} s)" for k, v in parts.items()))
sys.exit(int(any(v["exit_code"] for v in parts.values())))
EOF
fi
