"""Drift: the checked-in CRD YAML (crds/ and the Helm chart) must equal the one generated from the models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from weightsync.crds import generate
from weightsync.crds.schema import crd

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_crd_matches_the_models() -> None:
    expected = generate.render()
    for path in generate.targets(REPO):
        assert path.exists(), f"{path} missing: run `make crds`"
        assert path.read_text() == expected, f"{path} is stale: run `make crds`\n{generate.diff(path, expected)}"


def test_rendered_yaml_parses_back_to_the_crd() -> None:
    assert yaml.safe_load(generate.render()) == crd()


def test_render_is_deterministic() -> None:
    assert generate.render() == generate.render()


def test_check_mode_reports_drift_with_a_diff(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "weightsync.crds.generate", "--root", str(tmp_path)]
    first = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert first.returncode == 1  # nothing there yet
    subprocess.run(cmd, check=True, capture_output=True)
    for path in generate.targets(tmp_path):
        assert path.read_text() == generate.render()
    ok = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr

    stale = generate.targets(tmp_path)[1]
    stale.write_text(stale.read_text().replace("maximum: 16384", "maximum: 999"))
    bad = subprocess.run([*cmd, "--check"], capture_output=True, text=True, check=False)
    assert bad.returncode == 1
    assert "-                    maximum: 999" in bad.stdout and "+                    maximum: 16384" in bad.stdout
    assert "make crds" in bad.stderr
    assert stale.read_text().count("maximum: 999") == 1, "--check must not write"
