"""docs/operations.md must document every Prometheus metric the operator and the agent define, and every
condition reason the operator can set (collected from the code, so a new one fails here until documented)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from weightsync.agent.metrics import AgentMetrics
from weightsync.operator import metrics as operator_metrics

REPO = Path(__file__).resolve().parents[2]
OPERATIONS = REPO / "docs" / "operations.md"
CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]+$")


def _names(metrics: list[MetricWrapperBase]) -> set[str]:
    """Exposed family names: counters are exposed as `<name>_total` (the constructor may omit the suffix)."""
    out = set()
    for m in metrics:
        registry = CollectorRegistry()
        registry.register(m)
        for family in registry.collect():
            out.add(family.name + ("_total" if family.type == "counter" else ""))
    return out


def operator_metric_names() -> set[str]:
    found = [v for v in vars(operator_metrics).values() if isinstance(v, MetricWrapperBase)]
    return _names(found)


def agent_metric_names() -> set[str]:
    agent = AgentMetrics()
    found = [v for v in vars(agent).values() if isinstance(v, MetricWrapperBase)]
    names = _names(found)
    # Everything on the agent's registry is one of its attributes (nothing registered behind our back).
    assert {f.name for f in agent.registry.collect()} <= {n.removesuffix("_total") for n in names}
    return names


def test_every_metric_is_documented() -> None:
    text = OPERATIONS.read_text()
    names = operator_metric_names() | agent_metric_names()
    assert len(names) >= 20, names  # the collection really found them
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"metrics missing from {OPERATIONS.relative_to(REPO)} (add a row to the metrics table): {missing}"


# --- condition reasons ----------------------------------------------------------------------------------
def _str(node: ast.AST | None) -> list[str]:
    """String constants of an expression: a literal, or both branches of a conditional expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _str(node.body) + _str(node.orelse)
    return []


def _is_cond_type(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr.startswith("COND_")


def reasons_in(source: str) -> set[str]:
    """Condition reasons in one module: `REASON_* = "..."` constants, the reason argument of
    `put(COND_X, status, reason, ...)` / `set_condition(conds, COND_X, status, reason, ...)`, the reason of
    `(COND_X, status, reason, message)` tuples, and what `failure()` returns for a failing pod (it becomes
    the Degraded reason), plus Event reasons of `events.normal/warning(job, reason, ...)`."""
    tree = ast.parse(source)
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if any(isinstance(t, ast.Name) and t.id.startswith("REASON_") for t in node.targets):
                out.add(node.value.value)
        elif isinstance(node, ast.Call):
            args = node.args
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("normal", "warning") and len(args) >= 2:
                out.update(_str(args[1]))  # EventRecorder.normal/warning(job, reason, message)
            for i, a in enumerate(args[:-2]):
                if _is_cond_type(a):
                    out.update(_str(args[i + 2]))
        elif isinstance(node, ast.Tuple) and len(node.elts) == 4 and _is_cond_type(node.elts[0]):
            out.update(_str(node.elts[2]))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "WAITING_FAILURES"
                                                  for t in node.targets) and isinstance(node.value, ast.Tuple):
            for e in node.value.elts:  # waiting reasons that failure_detail() passes on as the Degraded reason
                out.update(_str(e))
        elif isinstance(node, ast.FunctionDef) and node.name in ("failure", "failure_detail"):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return):
                    value = sub.value.elts[0] if isinstance(sub.value, ast.Tuple) and sub.value.elts else sub.value
                    out.update(_str(value))
                elif isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "reason"
                                                         for t in sub.targets):
                    out.update(_str(sub.value))
                elif isinstance(sub, ast.Compare) and any(isinstance(op, ast.In) for op in sub.ops):
                    for comp in sub.comparators:
                        if isinstance(comp, ast.Tuple):
                            for e in comp.elts:
                                out.update(_str(e))
    return {r for r in out if CAMEL.match(r)}


def operator_reasons() -> set[str]:
    out: set[str] = set()
    for path in sorted((REPO / "operator").glob("*.py")):
        out |= reasons_in(path.read_text())
    return out


def test_reason_collection_finds_the_known_ones() -> None:
    found = operator_reasons()
    for known in ("InvalidSpec", "InvalidTemplate", "ObjectConflict", "ColocatedNeedsWholeNodeOrDRA", "GPUsExceedNode",
                  "PodsPending", "AllReplicasReady", "ReplicasBehind", "RollingOut", "SyncFailed", "ReplicasStale",
                  "Pausing", "PausedBySpec", "CrashLoopBackOff", "PodFailed", "VersionServed", "OOMKilled",
                  "RunContainerError", "UnprovenVersion"):
        assert known in found, (known, sorted(found))


def test_every_condition_reason_is_documented() -> None:
    text = OPERATIONS.read_text()
    section = text[text.index("## Troubleshooting"):]
    missing = sorted(r for r in operator_reasons() if f"`{r}`" not in section)
    assert not missing, (
        f"condition/event reasons set by operator/*.py but not documented under ## Troubleshooting in "
        f"{OPERATIONS.relative_to(REPO)}: {missing}"
    )
