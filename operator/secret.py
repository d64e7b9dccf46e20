"""The per-job Secret holding the transfer token the agents authenticate with (HMAC of control frames).

Created once: the reconciler only creates it when missing and never patches it, so a running job's token
never rotates under its agents. The token value is never logged or put into events.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any

from weightsync.crds import contract
from weightsync.operator.common import JobRef, metadata

TOKEN_BYTES = 32


def new_token() -> str:
    """A random 256-bit token, hex encoded."""
    return secrets.token_hex(TOKEN_BYTES)


def build_secret(job: JobRef, token: str | None = None) -> dict[str, Any]:
    value = token if token is not None else new_token()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": metadata(job, contract.token_secret_name(job.name)),
        "immutable": True,
        "data": {contract.TOKEN_FILE: base64.b64encode(value.encode()).decode()},
    }
