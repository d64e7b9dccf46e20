"""Version proofs (issue 15, F4): which versions written on pods the operator believes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weightsync.crds import contract, version_proof
from weightsync.operator import podstate, proofs
from weightsync.operator.common import JobRef
from weightsync.operator.config import OperatorConfig

KEY = b"k" * 64
JOB = JobRef(name="grpo", namespace="rl", uid="uid-1")


def _pod(uid: str, ann: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "uid": uid, "annotations": dict(ann)}}


def _proven(token: str, uid: str, **versions: str) -> dict[str, str]:
    ann = {contract.ANN_PUBLISHED_VERSION: versions.get("published", ""),
           contract.ANN_SERVED_VERSION: versions.get("served", "")}
    ann = {k: v for k, v in ann.items() if v}
    ann[contract.ANN_VERSION_PROOF] = version_proof.version_proof(token, uid, ann)
    return ann


def test_job_token_is_derived_from_the_key_and_the_job_identity() -> None:
    token = proofs.token_for(KEY, JOB)
    assert token is not None and len(token) == 64
    assert token == proofs.token_for(KEY, JOB), "the operator must derive the same token again after a restart"
    assert token != proofs.token_for(b"o" * 64, JOB)
    assert token != proofs.token_for(KEY, JobRef(name="grpo", namespace="rl", uid="uid-2")), "a re-created job"
    assert proofs.token_for(None, JOB) is None


def test_only_proven_versions_are_believed() -> None:
    token = proofs.token_for(KEY, JOB)
    assert token is not None
    pods = {
        "good": _pod("u1", _proven(token, "u1", published="7")),
        "forged": _pod("u2", {contract.ANN_PUBLISHED_VERSION: "100000", contract.ANN_SYNC_ERROR: "kept"}),
        "changed": _pod("u3", {**_proven(token, "u3", served="4"), contract.ANN_SERVED_VERSION: "100000"}),
        "copied": _pod("u4", _proven(token, "u1", published="7")),  # another pod's valid annotations
        "other-token": _pod("u5", _proven("0" * 64, "u5", published="9")),
        "nothing": _pod("u6", {}),
    }
    believed, unproven = proofs.believed(pods, token)
    assert unproven == ["changed", "copied", "forged", "other-token"]
    assert podstate.published_version(believed["good"]) == 7
    for name in unproven:
        assert podstate.published_version(believed[name]) is None
        assert podstate.served_version(believed[name]) is None
    assert podstate.sync_error(believed["forged"]) == "kept", "only the versions are dropped"
    assert podstate.published_version(pods["forged"]) == 100000, "the observed pods are not mutated"



def test_a_served_digest_is_believed_only_under_the_proof() -> None:
    token = proofs.token_for(KEY, JOB)
    assert token is not None
    ann = {contract.ANN_SERVED_VERSION: "4", contract.ANN_SERVED_DIGEST: "a" * 32}
    ann[contract.ANN_VERSION_PROOF] = version_proof.version_proof(token, "u1", ann)
    pods = {"good": _pod("u1", ann), "swapped": _pod("u2", {**ann, contract.ANN_SERVED_DIGEST: "b" * 32})}
    pods["swapped"]["metadata"]["uid"] = "u1"
    believed, unproven = proofs.believed(pods, token)
    assert unproven == ["swapped"]
    assert podstate.served_digest(believed["good"]) == "a" * 32
    assert podstate.served_digest(believed["swapped"]) is None and podstate.served_version(believed["swapped"]) is None


def test_proofs_are_enforced_only_for_jobs_whose_token_the_key_derived() -> None:
    kid = version_proof.key_id(KEY)
    assert proofs.enforced_key(KEY, {}, created_now=True) == kid
    assert proofs.enforced_key(KEY, {"versionProofKey": kid}, created_now=False) == kid
    # a job whose Secret predates the key (or was made under another key) cannot be checked
    assert proofs.enforced_key(KEY, {}, created_now=False) is None
    assert proofs.enforced_key(KEY, {"versionProofKey": version_proof.key_id(b"o" * 64)}, created_now=False) is None
    assert proofs.enforced_key(None, {"versionProofKey": kid}, created_now=True) is None


def test_operator_key_file(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_text("a" * 64 + "\n")
    cfg = OperatorConfig.from_env({"WEIGHTSYNC_OPERATOR_KEY_FILE": str(good)})
    assert cfg.operator_key == b"a" * 64
    assert "operator_key" not in repr(cfg) and "a" * 64 not in repr(cfg), "the key must never be printed"
    assert OperatorConfig.from_env({}).operator_key is None
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(ValueError, match="at least 32"):
        OperatorConfig.from_env({"WEIGHTSYNC_OPERATOR_KEY_FILE": str(short)})
    with pytest.raises(ValueError, match="cannot read"):
        OperatorConfig.from_env({"WEIGHTSYNC_OPERATOR_KEY_FILE": str(tmp_path / "missing")})


def test_a_proof_covers_every_present_version_annotation() -> None:
    token = "t" * 64
    ann = _proven(token, "u1", published="7")
    assert version_proof.verify(token, "u1", ann)
    for extra in contract.VERSION_PROOF_KEYS:
        if extra not in ann:
            assert not version_proof.verify(token, "u1", {**ann, extra: "3"}), f"{extra} added must not verify"
    assert not version_proof.verify(token, "u1", {k: v for k, v in ann.items() if k != contract.ANN_PUBLISHED_VERSION}
                                    | {contract.ANN_SERVED_VERSION: "7"}), "a moved value must not verify"
