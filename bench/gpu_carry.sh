#!/usr/bin/env bash
# Make the folder bench/gpu_check.sh reads on a GPU machine that has PyTorch but no package index:
#   CARRY/whl/           cp312 / pure-Python wheels of what that image lacks (the versions in this venv)
#   CARRY/nixl-slim.tgz  nixl + nixl_cu13, unpacked without the nixl_ep extension (94 MB of three torch builds;
#                        the whole wheel would not fit the 64 MiB a call carries)
#   CARRY/engines/       the pinned sglang / vllm files the engine tests read, with their dist-info (found by
#                        running those tests here with an audit hook on open(); a missing file fails the test
#                        loudly with EngineCodeMissing, never silently)
# Usage: bash bench/gpu_carry.sh [CARRY]   (default .devcarry, which .gitignore ignores)
set -euo pipefail
CARRY=${1:-.devcarry}
VPY=${VPY:-.venv/bin/python}
SITE=$($VPY -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$CARRY/whl"
ver() { $VPY -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=()
for d in pydantic pydantic_core annotated-types typing-inspection kopf kubernetes durationpy iso8601 jsonpatch \
         jsonpointer oauthlib requests-oauthlib websocket-client python-json-logger msgspec pybase64 aiohttp-retry; do
  pkgs+=("$d==$(ver "$d")")
done
$VPY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$CARRY/whl" "${pkgs[@]}"

tmp=$(mktemp -d)
$VPY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" "nixl==$(ver nixl)" "nixl-cu13==$(ver nixl-cu13)"
(cd "$tmp" && for w in *.whl; do unzip -q -o "$w"; done && rm -rf ./*.whl nixl_ep* nixl_cu13.libs/ucx/libucx_perftest* \
)
# `.` and not `./*`: the wheel's shared libraries live in a dot-directory (.nixl_cu13.mesonpy.libs)
tar czf "$CARRY/nixl-slim.tgz" -C "$tmp" .
rm -rf "$tmp"

rm -rf "$CARRY/engines" && mkdir -p "$CARRY/engines"
for f in sglang/__init__.py sglang/srt/entrypoints/http_server.py sglang/srt/managers/io_struct.py \
         sglang/srt/managers/scheduler_components/weight_updater.py \
         sglang/srt/model_executor/model_runner_components/weight_updater.py sglang/srt/utils/common.py \
         sglang/srt/utils/msgspec_utils.py sglang/srt/utils/patch_torch.py sglang/srt/weight_sync/tensor_bucket.py \
         vllm/__init__.py vllm/distributed/device_communicators/pynccl_wrapper.py vllm/distributed/weight_transfer/base.py \
         vllm/distributed/weight_transfer/ipc_engine.py vllm/distributed/weight_transfer/nccl_common.py \
         vllm/distributed/weight_transfer/nccl_engine.py vllm/distributed/weight_transfer/packed_tensor.py \
         vllm/entrypoints/rl/online/api_router.py vllm/entrypoints/serve/instrumentator/basic.py \
         vllm/entrypoints/serve/lora/api_router.py vllm/entrypoints/serve/lora/protocol.py \
         vllm/model_executor/model_loader/mtp_validation.py vllm/v1/engine/__init__.py vllm/v1/worker/gpu_worker.py; do
  mkdir -p "$CARRY/engines/$(dirname "$f")"
  cp "$SITE/$f" "$CARRY/engines/$f"
done
for d in "$SITE"/sglang-*.dist-info "$SITE"/vllm-*.dist-info; do
  cp -r "$d" "$CARRY/engines/" && rm -f "$CARRY/engines/$(basename "$d")/RECORD"
done
du -sh "$CARRY"
