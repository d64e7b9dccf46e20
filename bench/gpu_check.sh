#!/usr/bin/env bash
# The GPU tier in one call, on a machine with a CUDA GPU and PyTorch but no package index (the device machine):
#   1. the `gpu` tests that run on the GPUs there (CUDA IPC, pinned staging, the ring's device snapshot, the SGLang
#      adapter's CUDA paths against SGLang's own receive code; NCCL tests need 2-3 GPUs and say so);
#   2. the product path on the GPU: bench/agent_pipeline.py --device cuda (IPC colocated, GDR over NIXL), each
#      against its raw transport in the same run;
#   3. the CPU product path on that machine's cores, next to the 2-core figures in docs/performance.md.
#
# What it needs beside the repo, in CARRY (default .devcarry, ignored by git; `bench/gpu_carry.sh` makes it):
#   whl/*.whl        the pure-Python and cp312 wheels the image lacks (pydantic, kubernetes, kopf, msgspec, ...)
#   nixl-slim.tgz    nixl + nixl_cu13 1.5.1 unpacked, without the nixl_ep extension (the carry limit is 64 MiB)
#   engines/         the pinned sglang / vllm files the engine tests read (e2e/engines/released.py), and their
#                    dist-info
# Results go to $OUT (bench-results.json, cuda-ipc-namespaces.json, the pytest log and junit XML, diagnostics.log with
# the pods' and stand-ins' logs of what failed), a table at the end of the output.
set -uo pipefail
CARRY=${CARRY:-.devcarry}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
REPO=$(pwd)
PY=${PY:-python3}

echo "== machine"
nvidia-smi -L || true
nproc
df -T /tmp /dev/shm | tail -n +2
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
"nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)'

echo "== install the carried packages"
SITE=/tmp/site
mkdir -p "$SITE" /tmp/wspy/weightsync
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/whl/*.whl \
  || exit 1
tar xzf "$CARRY/nixl-slim.tgz" -C "$SITE" || exit 1
cp -r "$CARRY"/engines/. "$SITE"/
# the weightsync package as the editable install maps it (repo dirs -> weightsync.*), without the repo root on
# sys.path (its operator/ would shadow the standard library's operator module)
cp weightsync/__init__.py /tmp/wspy/weightsync/
for d in agent crds operator e2e; do ln -sfn "$REPO/$d" "/tmp/wspy/weightsync/$d"; done
export PYTHONPATH=/tmp/wspy:$SITE PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
"$PY" -c 'import weightsync.agent.main, weightsync.agent.transports.gdr, nixl, kopf; print("imports ok")' || exit 1

if [ "${MOE:-}" != 1 ]; then
echo "== CUDA IPC across namespaces"
timeout 120 "$PY" bench/cuda_ipc_namespaces.py --json | tee "$OUT/cuda-ipc-namespaces.json"
fi

echo "== gpu tests"
if [ "${MOE:-}" = 1 ]; then  # the MoE form: the agent's own CUDA paths only, then the two MoE benches below
  GPU_TESTS=(tests/agent/test_agent_gpu.py)
else
  GPU_TESTS=(tests/agent/test_agent_gpu.py tests/agent_process/test_ring_staging.py
             tests/engines/test_sglang_gpu.py tests/engines/test_vllm_gpu.py)
fi
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -m gpu -p no:cacheprovider -q -o addopts=-ra \
  --junitxml="$OUT/gpu-junit.xml" "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
# the engine stand-ins' own output (a crash there shows in the test only as a dropped connection)
find /tmp/pytest-of-* -name 'standin-*.log' 2>/dev/null \
  | while read -r f; do echo "-- $f"; tail -n 30 "$f"; done >>"$OUT/diagnostics.log"

latest_run() {  # the newest agent_pipeline run directory (its pods' logs)
  find /tmp -maxdepth 1 -name 'ws-bench-*' -printf '%T@ %p\n' | sort -n | tail -n 1 | cut -d' ' -f2-
}
RES=/tmp/gpu-results  # one JSON per run, merged into $OUT/bench-results.json (at most 8 files come back)
mkdir -p "$RES"
merge() {  # RES/*.json -> OUT/bench-results.json, a line each; after every run, so that a call stopped at its
  # limit still brings back what had finished
  "$PY" - "$RES" "$OUT/bench-results.json" <<'EOF'
import json, pathlib, sys
merged = {}
for f in sorted(pathlib.Path(sys.argv[1]).glob("agent-pipeline-*.json")):
    try:
        d = merged[f.stem] = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem}: no result")
        continue
    keys = ("end_to_end_s", "raw_s", "ratio", "trainer_blocked_s", "copies_per_byte", "peak_staging_bytes",
            "bit_exact", "trainer_sent_per_byte", "relayed_per_byte", "load_avg_1m", "tensors",
            "per_tensor_overhead_us", "ratio_at_base", "engine_calls", "buckets")
    print(f.stem, {k: d.get(k) for k in keys})
pathlib.Path(sys.argv[2]).write_text(json.dumps(merged, indent=1))
EOF
}
bench() {  # NAME ARGS...: one agent_pipeline run
  local name=$1; shift
  echo "== bench $name: $*"
  timeout "${BENCH_TIMEOUT:-170}" "$PY" bench/agent_pipeline.py "$@" --json >"$RES/$name.json" 2>"/tmp/$name.log" \
    || { echo "FAILED ($?)"; tail -20 "/tmp/$name.log"
         run=$(latest_run)  # the pods' own logs say where it stopped
         [ -n "$run" ] && find "$run" -name '*.log' -exec sh -c 'echo "-- $1"; tail -n 12 "$1"' _ {} \; \
           | tee -a "$OUT/diagnostics.log" | tail -n 80; }
  merge >/dev/null
}
if [ "${MOE:-}" = 1 ]; then  # MoE-scale versions (docs/performance.md): 1 GiB in 16,384 tensors, and in 256, per mode
  bench agent-pipeline-ipc-cuda-1024-moe16384 --mode ipc --device cuda --size-mb 1024 --tensors 16384
  bench agent-pipeline-gdr-cuda-1024-moe16384 --mode gdr --device cuda --size-mb 1024 --tensors 16384
elif [ "${QUICK:-}" = 1 ]; then  # the short form: IPC at 256 MiB only
  bench agent-pipeline-ipc-cuda-256 --mode ipc --device cuda --size-mb 256
else  # most wanted first: a call stopped at its limit keeps what had finished
bench agent-pipeline-ipc-cuda-1024 --mode ipc --device cuda --size-mb 1024
# fanOut Relay over GDR from GPU memory: each replica reads the buckets out of the CUDA receive slots of the one
# before it (three inference pods on the inference GPU), against the direct fan-out in the same call
bench agent-pipeline-gdr-cuda-256-replicas3-direct --mode gdr --device cuda --size-mb 256 --replicas 3 --versions 4
bench agent-pipeline-gdr-cuda-256-replicas3-relay --mode gdr --device cuda --size-mb 256 --replicas 3 --versions 4 \
  --fan-out relay
# whole versions hold 2 x the shard in the trainer's GPU memory; the ring holds depth x bucket
bench agent-pipeline-ring-gdr-cuda-1024 --mode gdr --device cuda --size-mb 1024 --staging ring
# UCX's own choice (0.46 GB/s raw on an H100: why?); here the CUDA transports named (same-node GPU memory:
# cuda_ipc), tcp for wire-up, and UCX's protocol choice printed into the pods' logs, kept in diagnostics.log
UCX_TLS=cuda_ipc,cuda_copy,tcp UCX_PROTO_INFO=y \
  bench agent-pipeline-gdr-cuda-ipc-tls-1024 --mode gdr --device cuda --size-mb 1024
run=$(latest_run)
# the bucket reads' protocol rows with the transports under them (40 lines of anything cut them off last time)
[ -n "$run" ] && grep -rh -A 6 "ucp_get" "$run" | head -n 120 >>"$OUT/diagnostics.log"
# the 16-core anomaly (3.9 s there against 0.6 s on 2 cores): rank processes launched as torchrun does (1
# intra-op thread each, the bench's default now), then as the earlier runs did (16 each: --threads-per-rank 0)
bench agent-pipeline-nccl-cpu-fsdp2-tp2-1024 --mode nccl --size-mb 1024 --fsdp 2 --inference-tp 2
bench agent-pipeline-nccl-cpu-fsdp2-tp2-1024-oversubscribed --mode nccl --size-mb 1024 --fsdp 2 \
  --inference-tp 2 --threads-per-rank 0
bench agent-pipeline-gdr-cuda-1024 --mode gdr --device cuda --size-mb 1024
fi

echo "== summary"
merge
grep -E "passed|failed|error" "$OUT/pytest-gpu.log" | tail -3
