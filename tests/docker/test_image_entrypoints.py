"""Every command the images are asked to run exists: the Dockerfile's ENTRYPOINTs, the `command:` of every
container the helm chart renders, the agent sidecar the operator injects into each example job's pods, and
the demo containers of the examples (which run the agent image). Each must be a [project.scripts] console
script whose entry point loads to a callable and whose `--help` exits 0 (or `python -m` of a module of the
distribution), and the wheel the Dockerfile builds from its build context must ship them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from dockerfile_rules import dockerignore_excludes, parse, stages, target_argv

from weightsync.crds.models import WeightSyncJobSpec
from weightsync.e2e.binaries import find_binary
from weightsync.operator.common import JobRef
from weightsync.operator.config import DEFAULT_AGENT_IMAGE, OperatorConfig
from weightsync.operator.placement import Plan, plan
from weightsync.operator.pods import build_pods

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "weightsync-operator"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
BIN = Path(sys.executable).parent
DOCKERFILE = (REPO / "Dockerfile").read_text()


def chart_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def make_images() -> dict[str, str]:
    """target -> the tag `make image` gives it (from `make -n`: nothing is built)."""
    out = subprocess.run(["make", "-n", "--no-print-directory", "image"], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    # images/build.sh builds each of TARGETS and tags it with <TARGET>_IMAGE
    found = {t.lower(): tag for t, tag in re.findall(r"\b(OPERATOR|AGENT)_IMAGE=(\S+)", out)}
    assert re.search(r'TARGETS="operator agent"', out) and "images/build.sh" in out, out
    assert set(found) == {"operator", "agent"}, out
    return found


def helm_containers() -> list[dict[str, Any]]:
    """Containers (and init containers) of every workload the chart renders: defaults, HA (peering),
    namespaced, and the opt-in CRD upgrade hook Job."""
    containers: list[dict[str, Any]] = []
    for extra in ([], ["--set", "replicaCount=2"], ["--set", "watchNamespaces={a,b}"],
                  ["--set", "crds.upgradeHook.enabled=true"]):
        rendered = subprocess.run(
            [str(find_binary("helm")), "template", "ws", str(CHART), "-n", "weightsync-system",
             "--kube-version", "1.34.4", *extra],
            capture_output=True, text=True, check=True, timeout=120,
        ).stdout
        for doc in yaml.safe_load_all(rendered):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec")
            if spec:
                containers += (spec.get("initContainers") or []) + spec["containers"]
    assert containers, "the chart renders no workload"
    return containers


def example_pods() -> list[dict[str, Any]]:
    """The pods the operator builds for every example job (the real builders, default config)."""
    pods: list[dict[str, Any]] = []
    cfg = OperatorConfig()
    for path in sorted((REPO / "examples").glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        spec = WeightSyncJobSpec.model_validate(body["spec"])
        name = body["metadata"]["name"]
        p = plan(name, spec, cfg.node_gpu_count, rdma_available=True)
        assert isinstance(p, Plan), f"{path.name}: {p}"
        pods += build_pods(JobRef(name=name, namespace="ns", uid="uid"), spec, p, cfg)
    assert pods
    return pods


def image_repo(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def commands() -> dict[str, list[str]]:
    """where -> argv of every container that runs one of our images."""
    ours = {image_repo(i) for i in make_images().values()}
    found: dict[str, list[str]] = {}
    for target in ("operator", "agent"):
        found[f"Dockerfile --target {target}"] = target_argv(DOCKERFILE, target)
    for c in helm_containers():
        assert image_repo(c["image"]) in ours, f"chart container {c['name']} runs {c['image']}, not our image"
        found[f"chart container {c['name']}"] = list(c.get("command") or target_argv(DOCKERFILE, "operator"))
    for pod in example_pods():
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            if image_repo(c["image"]) in ours:
                found[f"pod {pod['metadata']['name']} container {c['name']}"] = list(c.get("command") or [])
    return found


def test_make_image_tags_are_what_the_chart_and_the_operator_use() -> None:
    images = make_images()
    values = chart_values()
    assert images["operator"] == f"{values['image']['repository']}:{values['image']['tag'] or app_version()}"
    assert images["agent"] == f"{values['agent']['image']['repository']}:{values['agent']['image']['tag'] or app_version()}"
    assert images["agent"] == DEFAULT_AGENT_IMAGE  # the operator's default sidecar image
    # The demo examples run the agent image for their trainer and engine containers (kind loads that tag).
    for name in ("demo-separated.yaml", "demo-colocated.yaml"):
        text = (REPO / "examples" / name).read_text()
        assert f"image: {images['agent']}" in text, name


def test_every_command_is_found() -> None:
    found = commands()
    assert any(k.startswith("chart container") for k in found)
    sidecars = {k: v for k, v in found.items() if k.endswith("container weightsync-agent")}
    assert sidecars and all(v == ["weightsync-agent"] for v in sidecars.values()), sidecars
    assert any(v[0] == "python" for v in found.values()), "the demo examples' containers were not collected"


def _check_console_script(name: str) -> None:
    assert name in SCRIPTS, f"{name!r} is not a [project.scripts] console script of pyproject.toml"
    eps = importlib.metadata.entry_points(group="console_scripts", name=name)
    assert len(eps) == 1, f"{name}: not installed in {sys.prefix} (`pip install -e .`)"
    ep = next(iter(eps))
    assert ep.value == SCRIPTS[name], f"{name}: installed {ep.value}, pyproject says {SCRIPTS[name]} (reinstall)"
    assert callable(ep.load())
    script = BIN / name
    assert script.exists(), script
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: {name}" in proc.stdout


def _check_python_module(argv: list[str]) -> None:
    assert argv[0] in ("python", "python3") and argv[1] == "-m", argv
    module = argv[2]
    assert module.startswith("weightsync."), f"{module}: not a module of the weightsync distribution"
    assert importlib.util.find_spec(module) is not None, module
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout


def test_every_command_exists_and_answers_help() -> None:
    checked: dict[tuple[str, ...], list[str]] = {}
    for where, cmd in commands().items():
        checked.setdefault(tuple(cmd), []).append(where)
    failures = []
    for argv, users in sorted(checked.items()):
        try:
            assert argv, "a container of ours with no command (name it: the image's ENTRYPOINT is implicit)"
            if argv[0] in ("python", "python3"):
                _check_python_module(list(argv))
            else:
                _check_console_script(argv[0])
        except AssertionError as exc:
            failures.append(f"{' '.join(argv[:3])} (used by {', '.join(users[:3])}): {exc}")
    assert not failures, "\n".join(failures)
    # The distinct commands: the console scripts, the demo modules (the tiny-Llama trainer and the RL trainer
    # too), the SGLang stand-in engine and the real vLLM server's launcher.
    assert {a[0] for a in checked} >= {"weightsync-operator", "weightsync-agent", "weightsync-crds", "python"}
    assert {a[2] for a in checked if a[0] == "python"} == {
        "weightsync.agent.demo.trainer", "weightsync.agent.demo.engine", "weightsync.agent.demo.llama_trainer",
        "weightsync.agent.demo.rl_trainer", "weightsync.e2e.engines.sglang_standin",
        "weightsync.e2e.engines.vllm_server"}


def test_a_missing_script_fails_the_check() -> None:
    with pytest.raises(AssertionError, match=r"not a \[project.scripts\]"):
        _check_console_script("weightsync-nonexistent")
    with pytest.raises(AssertionError):
        _check_python_module(["python", "-m", "weightsync.agent.no_such_module"])


# --- the wheel the builder stage makes ----------------------------------------------------------------------
def build_context(dest: Path) -> None:
    """What the builder stage COPYs, through .dockerignore (as `docker build` would send it)."""
    ignore = (REPO / ".dockerignore").read_text()
    builder = next(s for s in stages(parse(DOCKERFILE)) if s.name == "builder")
    for ins in builder.instructions:
        if ins.cmd != "COPY" or ins.flags:
            continue
        for src in ins.value.split()[:-1]:
            root = REPO / src
            files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if not dockerignore_excludes(ignore, rel):
                    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dest / rel)


def test_wheel_from_the_build_context_ships_the_scripts(tmp_path: Path) -> None:
    ctx, out = tmp_path / "ctx", tmp_path / "wheels"
    ctx.mkdir()
    build_context(ctx)
    assert not list(ctx.rglob("__pycache__")), "the context carries __pycache__ (.dockerignore)"
    # As in the builder stage: `pip wheel .` from the context's root, with no environment settings (the
    # root's operator/ folder, a namespace portion, must not shadow the standard library's operator module).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-cache-dir", "--wheel-dir", str(out), "."],
                          cwd=ctx, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("weightsync-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta_dir = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = z.read(f"{meta_dir}/entry_points.txt").decode()
        metadata = z.read(f"{meta_dir}/METADATA").decode()
    for script, target in SCRIPTS.items():
        assert re.search(rf"^{re.escape(script)}\s*=\s*{re.escape(target)}$", entry_points, re.M), entry_points
        module = target.split(":")[0]
        assert module.replace(".", "/") + ".py" in names, module
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        folder = package.replace(".", "/")
        if package == "weightsync.operator":  # a namespace portion (no __init__.py): its modules ship
            assert {f"{folder}/main.py", f"{folder}/reconcile.py"} <= names, package
        else:
            assert folder + "/__init__.py" in names, package
    assert "weightsync/agent/demo/trainer.py" in names and "weightsync/agent/demo/engine.py" in names
    assert "weightsync/e2e/engines/sglang_standin.py" in names
    # the vLLM plugin ships in the wheel, with the entry point vLLM loads it from in every process
    assert "weightsync/agent/engines/vllm_plugin.py" in names and "weightsync/agent/engines/vllm_wire.py" in names
    assert re.search(r"^\[vllm\.general_plugins\]\nweightsync = weightsync\.agent\.engines\.vllm_plugin:register$",
                     entry_points, re.M), entry_points
    # torch / nixl only through the extras: the operator target (no extras) gets neither.
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    for req in requires:
        if re.match(r"(torch|nixl)\b", req):
            assert "extra ==" in req, req
