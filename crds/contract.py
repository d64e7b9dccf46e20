"""Names shared by the operator and the agent: one place, so neither side spells them twice.

The operator writes these (labels, annotations, env, mounted files); the agent reads them. Changing a
value here is a wire change between operator and agent versions.
"""

from __future__ import annotations

from typing import Final

# --- API identity -------------------------------------------------------------------------------------
GROUP: Final = "weightsync.io"
VERSION: Final = "v1alpha1"
# GROUP/VERSION spelled out, so that its type is the literal `models.WeightSyncJob.api_version` declares
# (tests/crds/test_crd_models.py checks that it still equals GROUP/VERSION).
API_VERSION: Final = "weightsync.io/v1alpha1"
KIND: Final = "WeightSyncJob"
PLURAL: Final = "weightsyncjobs"
SINGULAR: Final = "weightsyncjob"
SHORT_NAME: Final = "wsj"
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# --- Labels on every object the operator owns ---------------------------------------------------------
LABEL_JOB: Final = f"{GROUP}/job"            # the WeightSyncJob's name
LABEL_ROLE: Final = f"{GROUP}/role"          # one of ROLE_*
LABEL_REPLICA: Final = f"{GROUP}/replica"    # inference replica index ("0", "1", ...)
LABEL_RANK: Final = f"{GROUP}/rank"          # pod index within its role / replica
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "weightsync-operator"

ROLE_TRAINER: Final = "trainer"
ROLE_INFERENCE: Final = "inference"
ROLE_COLOCATED: Final = "colocated"

# --- Desired state (operator -> agent): these names are kept in the job's desired-state ConfigMap -------
# (desired_configmap_name; crds/desired.py), one entry per pod, no longer written on the pods themselves.
ANN_TARGET_VERSION: Final = f"{GROUP}/target-version"   # the version this inference pod should load
ANN_TARGET_EPOCH: Final = f"{GROUP}/target-epoch"       # ... of this trainer epoch (absent: 0)
ANN_PAUSED: Final = f"{GROUP}/paused"                   # "true" while spec.paused (engine paused)
ANN_MEMBERSHIP_GENERATION: Final = f"{GROUP}/membership-generation"
# spec.updatePolicy.strategy Atomic (operator/atomic.py, agent/atomic.py): a two-phase update. commit-version
# above committed-version: every replica leaves the Service (drain); committed-version: the version Ready
# replicas serve (agents load their prepared copy of it). Absent or empty on pods of a Rolling job.
ANN_COMMIT_VERSION: Final = f"{GROUP}/commit-version"
ANN_COMMIT_EPOCH: Final = f"{GROUP}/commit-epoch"
ANN_COMMITTED_VERSION: Final = f"{GROUP}/committed-version"
ANN_COMMITTED_EPOCH: Final = f"{GROUP}/committed-epoch"
ATOMIC_POD_ANNOTATIONS: Final = (ANN_COMMIT_VERSION, ANN_COMMIT_EPOCH, ANN_COMMITTED_VERSION, ANN_COMMITTED_EPOCH)
DESIRED_POD_ANNOTATIONS: Final = (ANN_TARGET_VERSION, ANN_TARGET_EPOCH, ANN_PAUSED, ANN_MEMBERSHIP_GENERATION,
                                  *ATOMIC_POD_ANNOTATIONS)
# Fault injection (tests, chaos drills; set by hand on one pod): "prepare" makes this agent's Atomic prepare
# fail. Anyone who may patch the pod may delete it too, so this grants nothing new.
ANN_INJECT_FAULT: Final = f"{GROUP}/inject-fault"

# --- Annotations: observed state (agent -> its own pod -> operator) -----------------------------------
ANN_SERVED_VERSION: Final = f"{GROUP}/served-version"     # inference: last fully loaded version
ANN_PUBLISHED_VERSION: Final = f"{GROUP}/published-version"  # trainer: last version staged by the trainer
# Trainer epoch: bumped by the trainer agent when a new trainer process starts publishing again from a
# version it already published (a restarted trainer at 1 is a new epoch, not a stale one). Versions are
# ordered by (epoch, version); an absent epoch is 0.
ANN_PUBLISHED_EPOCH: Final = f"{GROUP}/published-epoch"      # trainer: the epoch of published-version
ANN_SERVED_EPOCH: Final = f"{GROUP}/served-epoch"            # inference: the epoch of served-version
ANN_ENGINE_PAUSED: Final = f"{GROUP}/engine-paused"       # "true" once the engine confirmed a pause
ANN_LAST_SYNC: Final = f"{GROUP}/last-sync"               # JSON: {version, durationSeconds, bytes, mode}
ANN_SYNC_ERROR: Final = f"{GROUP}/sync-error"             # last failure message, cleared on success
# JSON {version, bucket, buckets, bytes, totalBytes} of the load under way (at most one write a second),
# removed when it ends
ANN_SYNC_PROGRESS: Final = f"{GROUP}/sync-progress"
# HMAC (job token) over the pod uid and the version annotations below: only the agent, which holds the
# job's token, can write a version the operator believes (crds/version_proof.py).
ANN_VERSION_PROOF: Final = f"{GROUP}/version-proof"
# inference, Atomic: the version this agent fetched, verified and holds (not served) until the commit
ANN_PREPARED_VERSION: Final = f"{GROUP}/prepared-version"
ANN_PREPARED_EPOCH: Final = f"{GROUP}/prepared-epoch"
# inference: the content digest of served-version as this pod's agent checked it (agent/transfer/digest.py; 32 hex)
ANN_SERVED_DIGEST: Final = f"{GROUP}/served-digest"
VERSION_PROOF_KEYS: Final = (ANN_PUBLISHED_VERSION, ANN_PUBLISHED_EPOCH, ANN_SERVED_VERSION, ANN_SERVED_EPOCH,
                             ANN_PREPARED_VERSION, ANN_PREPARED_EPOCH, ANN_SERVED_DIGEST)
# Everything an agent reports on its own pod (its observed state): what a report pushed to the operator may
# carry (crds/report_push.py). The version keys among them are believed only under ANN_VERSION_PROOF.
REPORTED_POD_ANNOTATIONS: Final = (*VERSION_PROOF_KEYS, ANN_VERSION_PROOF, ANN_ENGINE_PAUSED, ANN_LAST_SYNC,
                                   ANN_SYNC_ERROR, ANN_SYNC_PROGRESS)
# In the job's desired-state ConfigMap: where the active operator takes agents' reports
# (http://<address>:<port>/v1/reports). A data key no pod name can be (pod names have no "_").
DESIRED_REPORT_TO_KEY: Final = "_report-to"
REPORT_PATH: Final = "/v1/reports"
# Agent: how long after the operator acknowledged a pushed report its pod is written anyway (the durable
# record; later reports of that interval go in the same write). Default 10 s (x a random 1 to 1.5).
ENV_REPORT_WRITE_DELAY: Final = "WEIGHTSYNC_REPORT_WRITE_DELAY_SECONDS"
# The job's Degraded reason when replicas serving the same version hold different content digests.
REASON_DIGEST_MISMATCH: Final = "DigestMismatch"
# On the WeightSyncJob (operator-written): the id of the operator key its token was derived from. Version
# proofs are enforced for a job only when this matches the running operator's key.
ANN_VERSION_PROOF_KEY: Final = f"{GROUP}/version-proof-key"

# --- Pod condition / readiness gate --------------------------------------------------------------------
POD_CONDITION_SYNCED: Final = f"{GROUP}/synced"
# The synced condition's reason when the agent cannot reach its engine (the job's Degraded reason too).
REASON_ENGINE_UNREACHABLE: Final = "EngineUnreachable"
# Atomic: the synced condition's reasons while a version switch is under way / the replica is not committed
REASON_ATOMIC_SWITCHING: Final = "AtomicSwitching"
REASON_NOT_COMMITTED: Final = "NotCommittedVersion"
REASON_COMMITTED: Final = "CommittedVersion"

# --- WeightSyncJob condition types (metav1.Condition) -------------------------------------------------
COND_READY: Final = "Ready"
COND_SYNCED: Final = "Synced"
COND_PROGRESSING: Final = "Progressing"
COND_PAUSED: Final = "Paused"
COND_DEGRADED: Final = "Degraded"
COND_COMPLETE: Final = "Complete"  # every trainer pod exited successfully (Separated)
JOB_CONDITION_TYPES: Final = (COND_READY, COND_SYNCED, COND_PROGRESSING, COND_PAUSED, COND_DEGRADED, COND_COMPLETE)

# --- Environment variables the operator sets on every container of an owned pod -----------------------
ENV_JOB: Final = "WEIGHTSYNC_JOB"
ENV_NAMESPACE: Final = "WEIGHTSYNC_NAMESPACE"
ENV_POD_NAME: Final = "WEIGHTSYNC_POD_NAME"
ENV_POD_IP: Final = "WEIGHTSYNC_POD_IP"
ENV_ROLE: Final = "WEIGHTSYNC_ROLE"
ENV_RANK: Final = "WEIGHTSYNC_RANK"                 # rank within the role (trainer rank / rank in replica)
ENV_WORLD_SIZE: Final = "WEIGHTSYNC_WORLD_SIZE"     # ranks within the role (trainer) or replica
ENV_REPLICA: Final = "WEIGHTSYNC_REPLICA"           # inference replica index
ENV_TOPOLOGY_PATH: Final = "WEIGHTSYNC_TOPOLOGY_PATH"
ENV_TOKEN_PATH: Final = "WEIGHTSYNC_TOKEN_PATH"
ENV_SOCKET_DIR: Final = "WEIGHTSYNC_SOCKET_DIR"
ENV_CONTROL_PORT: Final = "WEIGHTSYNC_CONTROL_PORT"
ENV_METRICS_PORT: Final = "WEIGHTSYNC_METRICS_PORT"
ENV_TRANSPORT_PORT: Final = "WEIGHTSYNC_TRANSPORT_PORT"
ENV_TRANSFER_MODE: Final = "WEIGHTSYNC_TRANSFER_MODE"
ENV_BUCKET_SIZE_MB: Final = "WEIGHTSYNC_BUCKET_SIZE_MB"
ENV_VERIFY: Final = "WEIGHTSYNC_VERIFY"
ENV_ENGINE_TYPE: Final = "WEIGHTSYNC_ENGINE_TYPE"
ENV_ENGINE_URL: Final = "WEIGHTSYNC_ENGINE_URL"
# Chaos drills on the engine's last hop (tests, drills; set by hand on one agent container, never by the
# operator): "engine-corrupt:<V>:<K>" flips a byte of bucket K of version V after its digest leaves were
# computed (the engine must refuse it); "engine-hang:<V>:<K>" stops the agent after bucket K of version V
# reached the engine, inside the open update (to be killed there). One-shot each.
ENV_ENGINE_FAULT: Final = "WEIGHTSYNC_ENGINE_FAULT"
ENV_LORA: Final = "WEIGHTSYNC_LORA"  # JSON of spec.inference.engine.lora (adapterName, config, pinned), if set

# --- Mounted paths inside owned pods -------------------------------------------------------------------
SOCKET_DIR: Final = "/var/run/weightsync"                 # emptyDir shared by the agent and the app
AGENT_SOCKET_NAME: Final = "agent.sock"
TOPOLOGY_DIR: Final = "/etc/weightsync/topology"          # the topology ConfigMap
TOPOLOGY_FILE: Final = "topology.json"
TOKEN_DIR: Final = "/etc/weightsync/token"                # the per-job Secret
TOKEN_FILE: Final = "token"
# memory-backed emptyDir shared by the agent and the app: staging segments, receive slots, IPC buckets. Not the
# app's /dev/shm, which stays the app's own (its size and contents are the app's business: NCCL, dataloaders).
STAGING_DIR: Final = "/var/run/weightsync-staging"

# --- Ports (per pod; every pod has its own IP) --------------------------------------------------------
CONTROL_PORT: Final = 47100     # agent <-> agent control channel (HMAC-authenticated frames)
METRICS_PORT: Final = 47101     # /healthz and /metrics
TRANSPORT_PORT: Final = 47102   # torch.distributed / NIXL listener
AGENT_PORTS: Final = (CONTROL_PORT, METRICS_PORT, TRANSPORT_PORT)

# --- Names of owned objects ----------------------------------------------------------------------------
AGENT_CONTAINER: Final = "weightsync-agent"


def trainer_pod_name(job: str, index: int) -> str:
    return f"{job}-trainer-{index}"


def inference_pod_name(job: str, replica: int, index: int) -> str:
    return f"{job}-inference-{replica}-{index}"


def colocated_pod_name(job: str, index: int) -> str:
    return f"{job}-colocated-{index}"


def service_name(job: str) -> str:
    return job


def routing_service_name(job: str) -> str:
    """The Service clients send requests to: Ready inference frontends only."""
    return f"{job}-inference"


def token_secret_name(job: str) -> str:
    return f"{job}-token"


def topology_configmap_name(job: str) -> str:
    return f"{job}-topology"


def desired_configmap_name(job: str) -> str:
    """What the operator asks of every pod of the job (target version, pause, membership generation, the
    Atomic commit): one ConfigMap the agents watch (crds/desired.py), not an annotation patch per pod."""
    return f"{job}-desired"


def service_account_name(job: str) -> str:
    return f"{job}-agent"


def network_policy_name(job: str) -> str:
    return f"{job}-agents"

# --- Local e2e: nodes whose pods the process runtime (weightsync.e2e.runtime) runs as host processes --
LABEL_PROCESS_NODE: Final = f"{GROUP}/process-node"   # value "true" on a process node

# --- Agent settings from spec.updatePolicy (operator -> agent env); defaults apply when unset ----------
ENV_PAUSE_GENERATION: Final = "WEIGHTSYNC_PAUSE_GENERATION"   # "true"/"false": pause engines around a load
ENV_MAX_STALENESS: Final = "WEIGHTSYNC_MAX_STALENESS"         # versions a replica may lag before synced=False
ENV_KUBE_ENABLED: Final = "WEIGHTSYNC_KUBE"                   # "false": agent runs without an API server
ENV_APP_SOCKET: Final = "WEIGHTSYNC_AGENT_SOCKET"             # app side: full path of the agent's Unix socket

# --- Operator bookkeeping on owned objects (written and read by the operator only) ---------------------
# On a pod template: app containers (comma-separated names) that also get the pod's Kubernetes API token.
# By default only the agent has it: with the token, an app container could annotate its own pod.
ANN_API_TOKEN_CONTAINERS: Final = f"{GROUP}/api-token-containers"
SERVICE_ACCOUNT_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"  # where in-cluster clients look
ANN_SPEC_HASH: Final = f"{GROUP}/spec-hash"              # hash of an owned object as built; differs => outdated
ANN_MEMBERSHIP_HASH: Final = f"{GROUP}/membership-hash"  # on the topology ConfigMap: hash of pods, ranks, IPs

# --- Node labels of GPU nodes (simulated ones in e2e/nodes.py; GPU feature discovery sets the nvidia.com ones
# on real clusters). `placement.topologyKey` may name any of the topology keys to pack pods into one domain.
RESOURCE_GPU: Final = "nvidia.com/gpu"
LABEL_GPU_PRODUCT: Final = "nvidia.com/gpu.product"        # e.g. "NVIDIA-H100-80GB-HBM3"
LABEL_GPU_COUNT: Final = "nvidia.com/gpu.count"            # GPUs on the node, e.g. "8"
LABEL_HOSTNAME: Final = "kubernetes.io/hostname"
LABEL_ZONE: Final = "topology.kubernetes.io/zone"
LABEL_RACK: Final = f"topology.{GROUP}/rack"               # no upstream standard for racks
LABEL_NVLINK_DOMAIN: Final = "nvidia.com/gpu.clique"       # NVLink domain (GFD's clique label on MNNVL systems)
TOPOLOGY_KEYS: Final = (LABEL_HOSTNAME, LABEL_NVLINK_DOMAIN, LABEL_RACK, LABEL_ZONE)
ENV_AGENT_DEVICE: Final = "WEIGHTSYNC_AGENT_DEVICE"           # "cpu" (default) or "cuda[:N]": transport buffers
ENV_TIMEOUT_SECONDS: Final = "WEIGHTSYNC_TIMEOUT_SECONDS"     # spec.transfer.timeoutSeconds: bound on one version's sync
# spec.transfer.deltaSync (set only when enabled; absent means full buckets). Only the GDR transport sends deltas.
ENV_FAN_OUT: Final = "WEIGHTSYNC_FAN_OUT"              # Direct (default) | Relay (spec.transfer.fanOut)
ENV_STAGING: Final = "WEIGHTSYNC_STAGING"              # trainer agent: version (default) | ring (spec.transfer.staging)
ENV_STAGING_DEPTH: Final = "WEIGHTSYNC_STAGING_DEPTH"  # ring slots per transfer (default 2)
ENV_DELTA_SYNC: Final = "WEIGHTSYNC_DELTA_SYNC"                                # "true"/"false": send changed words only
ENV_DELTA_MAX_CHANGED_FRACTION: Final = "WEIGHTSYNC_DELTA_MAX_CHANGED_FRACTION"  # 0..1: above it a full bucket is sent
