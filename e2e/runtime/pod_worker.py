"""One thread per pod: volumes, container lifecycle (init, native sidecars, app), probes, status, deletion.

The loop is level-triggered: every tick (or wake-up from the watch) it compares what runs with what the
latest pod object asks for, acts, and patches pods/status when the computed status changed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync.e2e.runtime.containers import Backoff, ContainerRunner, rfc3339
from weightsync.e2e.runtime.envvars import (
    EnvError,
    Lookup,
    container_env,
    expand,
    service_env,
    service_link_env,
)
from weightsync.e2e.runtime.events import EventRecorder
from weightsync.e2e.runtime.images import (
    ImageError,
    ImageStore,
    LocalImage,
    check_non_root,
    container_argv,
    container_user,
    find_in_image,
    image_env,
    image_wrapper_argv,
    supplementary_groups,
)
from weightsync.e2e.runtime.kube import ApiError, KubeClient, pod_path
from weightsync.e2e.runtime.launch import Mount, find_executable, keep_visible, wrapper_argv
from weightsync.e2e.runtime.orphans import RUNTIME_ID_ENV
from weightsync.e2e.runtime.pod_volumes import PodVolumes
from weightsync.e2e.runtime.probes import ProbeState, run_probe
from weightsync.e2e.runtime.status import KIND_APP, KIND_INIT, KIND_SIDECAR, comparable, status_patch
from weightsync.e2e.runtime.token import PodTokens
from weightsync.e2e.runtime.volumes import VolumeError

log = logging.getLogger(__name__)
JSON = dict[str, Any]


@dataclass
class RuntimeContext:
    """What every pod worker shares (built once by ProcessRuntime)."""

    client: KubeClient
    lookup: Lookup
    api_host: str
    api_port: int
    python_bin_dir: Path
    pods_dir: Path
    shm_root: Path
    claims_dir: Path
    backoff_base_s: float
    backoff_max_s: float
    volume_refresh_s: float
    tick_s: float
    resync_status_s: float
    host_ip: Callable[[str], str]
    allocate_ip: Callable[[str, str | None], str]
    release_ip: Callable[[str], None]
    events: EventRecorder
    runtime_id: str
    images: ImageStore | None = None  # image mode: containers whose image is in this store run from it
    # namespace -> (Service, proxy address, port map) for the service-link env (services.ServiceProxy.link_services)
    service_links: Callable[[str], list[tuple[JSON, str, dict[int, int]]]] | None = None


def pod_dir_name(namespace: str, name: str, uid: str) -> str:
    return f"{namespace}_{name}_{uid}"


class PodWorker:
    def __init__(self, ctx: RuntimeContext, pod: JSON, on_exit: Callable[[str], None]) -> None:
        meta = pod["metadata"]
        self.ctx = ctx
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.key = f"{self.namespace}/{self.name}"
        self.node_name: str = pod.get("spec", {}).get("nodeName", "")
        self.dir = ctx.pods_dir / pod_dir_name(self.namespace, self.name, self.uid)
        self._pod = pod
        self._gone = False
        self._stopping = False
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._on_exit = on_exit
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.key}", daemon=True)
        self.volumes = PodVolumes(self.dir, ctx.shm_root / self.uid, ctx.claims_dir)
        spec = pod.get("spec", {})
        self.tokens = PodTokens(ctx.client, self.namespace, spec.get("serviceAccountName", "default"), self.name, self.uid)
        backoff = lambda: Backoff(ctx.backoff_base_s, ctx.backoff_max_s)  # noqa: E731
        self.init_runners = [
            ContainerRunner(
                c, KIND_SIDECAR if c.get("restartPolicy") == "Always" else KIND_INIT, self.log_file(c["name"]), backoff()
            )
            for c in spec.get("initContainers") or []
        ]
        self.app_runners = [ContainerRunner(c, KIND_APP, self.log_file(c["name"]), backoff()) for c in spec.get("containers") or []]
        self.pod_ip = ""
        self.host_ip = ""
        self.start_time = rfc3339()
        self.initialized = not self.init_runners
        self.init_failed = False
        self.volume_error: str | None = None
        self._volumes_synced_at = 0.0
        self._synced_pod_rv: str | None = None
        self._last_status: JSON | None = None
        self._last_status_at = 0.0
        self._transitions: dict[str, tuple[str, str]] = {}
        self._terminal = False
        self._last_warning: dict[str, str] = {}
        self._last_patch_error = ""  # container (or "") -> last Warning message sent

    def _event(self, reason: str, message: str, container: str | None = None, warning: bool = False) -> None:
        """Record an Event; a Warning is sent only when its message changed (no spam from retries)."""
        if warning:
            key = container or ""
            if self._last_warning.get(key) == message:
                return
            self._last_warning[key] = message
        self.ctx.events.emit(self._pod, "Warning" if warning else "Normal", reason, message, container)

    # --- thread-safe entry points (called by the watch threads / runtime) -------------------------------
    def log_file(self, container: str) -> Path:
        return self.dir / f"{container}.log"

    def start(self) -> None:
        self._thread.start()

    def update(self, pod: JSON) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        """The pod object is deleted from the API (force delete, or our own grace-0 delete)."""
        self._gone = True
        self._wake.set()

    def stop(self) -> None:
        """Runtime shutdown: kill the processes, leave the pod object alone."""
        self._stopping = True
        self._wake.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the loop --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._setup()
            while True:
                with self._lock:
                    pod = self._pod
                if self._stopping:
                    self._kill_all(grace_cap_s=2.0)
                    self.volumes.cleanup()  # no tmpfs mount outlives the runtime; logs stay
                    return
                if self._gone:
                    self._kill_all(grace_cap_s=2.0)
                    self._cleanup()
                    return
                if pod["metadata"].get("deletionTimestamp"):
                    self._terminate(pod)
                    return
                try:
                    self._sync(pod)
                except Exception:
                    log.exception("pod sync failed pod=%s uid=%s", self.key, self.uid)
                self._wake.wait(self.ctx.tick_s)
                self._wake.clear()
        except Exception:
            log.exception("pod worker crashed pod=%s uid=%s; killing its processes", self.key, self.uid)
            self._kill_all(grace_cap_s=1.0)
            self.volumes.cleanup()
        finally:
            self._on_exit(self.uid)

    def _setup(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        status = self._pod.get("status") or {}
        self.host_ip = self.ctx.host_ip(self._pod["spec"].get("nodeName", ""))
        if self._pod["spec"].get("hostNetwork"):
            self.pod_ip = self.host_ip  # the host's network: no address of its own
        else:
            self.pod_ip = self.ctx.allocate_ip(self.uid, status.get("podIP"))
        self.start_time = status.get("startTime") or rfc3339()
        log.info("pod admitted pod=%s uid=%s ip=%s dir=%s", self.key, self.uid, self.pod_ip, self.dir)

    def _sync(self, pod: JSON) -> None:
        now = time.monotonic()
        rv = pod["metadata"].get("resourceVersion")
        if now - self._volumes_synced_at >= self.ctx.volume_refresh_s or rv != self._synced_pod_rv:
            self._synced_pod_rv = rv
            self._volumes_synced_at = now
            try:
                self.volumes.sync(pod, self.pod_ip, self.host_ip, self.ctx.lookup, self.tokens)
                self.volume_error = None
            except VolumeError as exc:
                if self.volume_error != str(exc):
                    log.warning("volumes not ready pod=%s error=%s", self.key, exc)
                    self._event("FailedMount", str(exc), warning=True)
                self.volume_error = str(exc)
        for runner in self.init_runners + self.app_runners:
            if runner.reap():
                term = runner.state["terminated"]
                log.info(
                    "container exited pod=%s container=%s exit_code=%s restarts=%d",
                    self.key, runner.name, term["exitCode"], runner.restart_count,
                )
        if not self._terminal:
            self._drive(pod, now)
        self._probe_all(pod, time.monotonic())
        self._publish(pod)

    # --- container lifecycle ---------------------------------------------------------------------------
    def _drive(self, pod: JSON, now: float) -> None:
        policy = pod["spec"].get("restartPolicy", "Always")
        for runner in self.init_runners:
            if runner.kind == KIND_SIDECAR:
                self._keep_running(pod, runner, now, "Always")
                if not runner.started and not self.initialized:
                    return  # the next init container waits for this sidecar to have started
                continue
            if self.initialized or runner.completed:
                continue
            term = runner.state.get("terminated")
            if runner.running:
                return
            if term is not None and term.get("exitCode") == 0:
                runner.completed = True
                continue
            if term is not None and policy == "Never":
                self.init_failed = True
                self._finish(pod, "init container failed")
                return
            self._keep_running(pod, runner, now, "OnFailure")
            return
        if not self.initialized:
            self.initialized = True
            log.info("pod initialized pod=%s", self.key)
        for runner in self.app_runners:
            self._keep_running(pod, runner, now, policy)
        if all(r.state.get("terminated") and not r.wants_restart(policy) for r in self.app_runners):
            self._finish(pod, "all containers terminated")

    def _keep_running(self, pod: JSON, runner: ContainerRunner, now: float, policy: str) -> None:
        """Start a container that never ran, restart one that exited (if the policy says so) after backoff."""
        if runner.running:
            return
        term = runner.state.get("terminated")
        if term is not None:
            if not runner.wants_restart(policy):
                return
            delay = runner.schedule_restart(now)
            if delay > 0:
                message = f"back-off {delay:g}s restarting failed container={runner.name} pod={self.name}"
                runner.set_waiting("CrashLoopBackOff", message)
                self._event("BackOff", f"Back-off restarting failed container {runner.name}", runner.name, warning=True)
                return
        if now < runner.next_start_at:
            return
        self._launch(pod, runner, now)

    def _launch(self, pod: JSON, runner: ContainerRunner, now: float) -> None:
        retry_at = now + max(self.ctx.backoff_base_s, 1.0)
        if self.volume_error:
            runner.set_waiting("ContainerCreating", self.volume_error)
            runner.next_start_at = retry_at
            return
        spec = runner.spec
        try:
            env = self._env(pod, spec)
            mounts = keep_visible(self.volumes.mounts_for(pod, spec), self._host_env_paths())
        except (EnvError, VolumeError) as exc:
            reason = exc.reason if isinstance(exc, EnvError) else "CreateContainerConfigError"
            runner.set_waiting(reason, str(exc))
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {exc}", runner.name, warning=True)
            return
        image = self._image(spec)
        if image is not None:
            self._launch_from_image(pod, runner, image, self.volumes.mounts_for(pod, spec), now)
            return
        argv = [expand(a, env) for a in (spec.get("command") or []) + (spec.get("args") or [])]
        if not spec.get("command"):
            message = (
                f"container {runner.name} has no command: the process runtime runs `command`+`args` on the host "
                "and cannot run an image entrypoint; set `command`"
            )
            runner.set_waiting("CreateContainerError", message)
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {message}", runner.name, warning=True)
            return
        workdir = spec.get("workingDir") or str(self.dir / "rootfs")
        if find_executable(argv[0], env, workdir, mounts) is None:
            message = (
                f'exec: "{argv[0]}": executable file not found in $PATH={env.get("PATH", "")} '
                "(the process runtime runs commands from the host and the project's Python environment)"
            )
            runner.set_waiting("ExecutableNotFound", message)
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {message}", runner.name, warning=True)
            return
        runner.launch(wrapper_argv(mounts, workdir, argv), env, now)
        self._last_warning.pop(runner.name, None)
        self._event("Started", f"Started container {runner.name}", runner.name)
        log.info(
            "container started pod=%s container=%s kind=%s pid=%s restarts=%d argv=%s",
            self.key, runner.name, runner.kind, runner.pid, runner.restart_count, argv,
        )

    def _image(self, spec: JSON) -> LocalImage | None:
        """The container's image from the runtime's image store (image mode), else None: a host process."""
        if self.ctx.images is None or not spec.get("image"):
            return None
        try:
            return self.ctx.images.get(str(spec["image"]))
        except Exception as exc:  # a broken store: say so and run on the host as without one
            log.warning("image store failed pod=%s image=%s: %s", self.key, spec.get("image"), exc)
            return None

    def _launch_from_image(self, pod: JSON, runner: ContainerRunner, image: LocalImage, mounts: list[Mount],
                           now: float) -> None:
        """Image mode: the container's root is an overlay over the image, argv from its Entrypoint/Cmd, env
        from the image then the pod, user from the pod's securityContext or the image's USER."""
        spec = runner.spec
        retry_at = now + max(self.ctx.backoff_base_s, 1.0)
        try:
            base = {**image_env(image.config), "HOSTNAME": self.name, RUNTIME_ID_ENV: self.ctx.runtime_id,
                    **self._service_links(pod), **service_env(self.ctx.api_host, self.ctx.api_port)}
            base.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            env = container_env(pod, spec, self.pod_ip, self.host_ip, self.ctx.lookup, base)
            uid, gid = container_user(pod, spec, image)
            check_non_root(pod, spec, uid)
        except (EnvError, ImageError) as exc:
            runner.set_waiting(exc.reason, str(exc))
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {exc}", runner.name, warning=True)
            return
        argv = [expand(a, env) for a in container_argv(spec, image.config)]
        workdir = spec.get("workingDir") or image.config.workdir or "/"
        if not argv or find_in_image(argv[0], env, workdir, image) is None:
            message = (f'exec: "{argv[0] if argv else ""}": executable file not found in the image {image.ref} '
                       f'(PATH={env.get("PATH", "")})')
            runner.set_waiting("CreateContainerError", message)
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {message}", runner.name, warning=True)
            return
        container_dir = str(self.dir / "containers" / runner.name)
        try:
            wrapper = image_wrapper_argv(image, container_dir, mounts, workdir, uid, gid, argv, supplementary_groups(pod))
        except ImageError as exc:  # e.g. a symlink loop in the image under a mountPath
            runner.set_waiting(exc.reason, str(exc))
            runner.next_start_at = retry_at
            self._event("Failed", f"Error: {exc}", runner.name, warning=True)
            return
        runner.launch(wrapper, env, now)
        self._last_warning.pop(runner.name, None)
        self._event("Started", f"Started container {runner.name}", runner.name)
        log.info("container started pod=%s container=%s kind=%s pid=%s restarts=%d image=%s uid=%d argv=%s",
                 self.key, runner.name, runner.kind, runner.pid, runner.restart_count, image.ref, uid, argv)

    def _host_env_paths(self) -> list[str]:
        """What the host processes run from: the Python environment and the project's source tree."""
        import weightsync

        return [str(self.ctx.python_bin_dir.parent), str(Path(weightsync.__file__).resolve().parent.parent)]

    def _service_links(self, pod: JSON) -> dict[str, str]:
        """The kubelet's service links (`enableServiceLinks`, default true): every proxied Service of the pod's
        namespace, at the proxy's address. The pod's own env is applied on top (it wins), and `$(VAR)` in
        command/args sees them."""
        if self.ctx.service_links is None or pod.get("spec", {}).get("enableServiceLinks") is False:
            return {}
        return service_link_env(self.ctx.service_links(self.namespace))

    def _env(self, pod: JSON, spec: JSON) -> dict[str, str]:
        base = {
            "PATH": f"{self.ctx.python_bin_dir}:{os.environ.get('PATH', os.defpath)}",
            "HOME": "/root",
            "HOSTNAME": self.name,
            "PYTHONUNBUFFERED": "1",
            RUNTIME_ID_ENV: self.ctx.runtime_id,
            **{k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TZ")},
            **self._service_links(pod),
            **service_env(self.ctx.api_host, self.ctx.api_port),
        }
        env = container_env(pod, spec, self.pod_ip, self.host_ip, self.ctx.lookup, base)
        if not env.get("PATH", "").startswith(f"{self.ctx.python_bin_dir}:"):
            env["PATH"] = f"{self.ctx.python_bin_dir}:{env.get('PATH', os.defpath)}"
        return env

    # --- probes ----------------------------------------------------------------------------------------
    def _probe_all(self, pod: JSON, now: float) -> None:
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        for runner in self.init_runners + self.app_runners:
            if not runner.running:
                continue
            if runner.kind == KIND_INIT:
                runner.started = True
                continue
            if runner.startup is not None and not runner.started:
                self._probe_once(runner, runner.startup, now)
                if runner.startup.result is True:
                    runner.started = True
                elif runner.startup.result is False:
                    self._probe_kill(runner, "startup", grace)
                    continue
                else:
                    continue
            if runner.liveness is not None:
                self._probe_once(runner, runner.liveness, now)
                if runner.liveness.result is False:
                    self._probe_kill(runner, "liveness", grace)
                    continue
            if runner.readiness is not None:
                self._probe_once(runner, runner.readiness, now)
                runner.ready = bool(runner.readiness.result)
            else:
                runner.ready = runner.started

    def _probe_once(self, runner: ContainerRunner, probe: ProbeState, now: float) -> None:
        if probe.due(now):
            result = run_probe(probe.spec, self.pod_ip, runner.pid, runner.env, runner.spec.get("ports") or [])
            before = probe.result
            probe.record(result, time.monotonic())
            if probe.result != before:
                log.info(
                    "probe verdict changed pod=%s container=%s result=%s message=%s",
                    self.key, runner.name, probe.result, result.message,
                )
                if probe.result is False:
                    which = next(k for k in ("readinessProbe", "livenessProbe", "startupProbe") if runner.spec.get(k) is probe.spec)
                    self._event("Unhealthy", f"{which[:-5].capitalize()} probe failed: {result.message}", runner.name, warning=True)

    def _probe_kill(self, runner: ContainerRunner, which: str, grace: float) -> None:
        probe_spec = runner.spec.get(f"{which}Probe") or {}
        grace = float(probe_spec.get("terminationGracePeriodSeconds", grace))
        log.info("container failed %s probe, restarting pod=%s container=%s", which, self.key, runner.name)
        self._event("Killing", f"Container {runner.name} failed {which} probe, will be restarted", runner.name)
        runner.kill(grace)

    # --- status ----------------------------------------------------------------------------------------
    def _publish(self, pod: JSON, force: bool = False) -> None:
        views = [r.view() for r in self.init_runners + self.app_runners]
        patch = status_patch(
            pod, views, pod_ip=self.pod_ip, host_ip=self.host_ip, start_time=self.start_time,
            sandbox_ready=True, initialized=self.initialized, init_failed=self.init_failed,
            transitions=self._transitions, now=rfc3339(),
        )
        if self._terminal and patch["status"]["phase"] == "Running":
            patch["status"]["phase"] = "Failed"
        now = time.monotonic()
        stale = now - self._last_status_at >= self.ctx.resync_status_s
        if not force and not stale and self._last_status is not None and comparable(patch) == self._last_status:
            return
        try:
            self.ctx.client.patch(pod_path(self.namespace, self.name, "status"), patch)
        except ApiError as exc:
            if exc.status == 404:
                self.gone()
            elif self._last_patch_error != str(exc):  # one line per distinct error, not one per tick
                log.warning("status patch failed pod=%s error=%s", self.key, exc)
            self._last_patch_error = str(exc)
            return
        self._last_patch_error = ""
        self._last_status = comparable(patch)
        self._last_status_at = now
        for cond in patch["status"]["conditions"]:
            self._transitions[cond["type"]] = (cond["status"], cond["lastTransitionTime"])

    def _finish(self, pod: JSON, why: str) -> None:
        """The pod is terminal (Succeeded / Failed): stop its sidecars, never restart anything again."""
        self._terminal = True
        log.info("pod finished pod=%s reason=%s", self.key, why)
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        for runner in reversed(self.init_runners):
            runner.kill(grace)

    # --- deletion --------------------------------------------------------------------------------------
    def _kill_all(self, grace_cap_s: float | None = None, grace_s: float = 30.0) -> None:
        """Regular containers first (together), then sidecars in reverse order, each within the grace period."""
        grace = grace_s if grace_cap_s is None else min(grace_s, grace_cap_s)
        deadline = time.monotonic() + grace
        apps = [r for r in self.app_runners if r.running]
        self._pre_stop(apps, deadline)
        for runner in apps:
            runner.signal(15)
        for runner in apps:
            runner.kill(max(deadline - time.monotonic(), 0.0))
        for runner in reversed(self.init_runners):
            if runner.running:
                self._pre_stop([runner], deadline)
            runner.kill(max(deadline - time.monotonic(), 2.0 if grace > 0 else 0.0))

    def _pre_stop(self, runners: list[ContainerRunner], deadline: float) -> None:
        """Run the containers' preStop hooks (exec, httpGet, sleep) concurrently, within the grace period."""

        def hook(runner: ContainerRunner, spec: JSON) -> None:
            budget = max(deadline - time.monotonic(), 0.0)
            if "sleep" in spec:
                time.sleep(min(float(spec["sleep"].get("seconds", 0)), budget))
                return
            result = run_probe(
                {**spec, "timeoutSeconds": budget}, self.pod_ip, runner.pid, runner.env, runner.spec.get("ports") or []
            )
            if not result.ok:
                self._event("FailedPreStopHook", f"PreStopHook failed: {result.message}", runner.name, warning=True)

        threads = []
        for runner in runners:
            spec = (runner.spec.get("lifecycle") or {}).get("preStop")
            if spec and runner.running:
                thread = threading.Thread(target=hook, args=(runner, spec), daemon=True)
                thread.start()
                threads.append(thread)
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _terminate(self, pod: JSON) -> None:
        meta = pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        log.info("pod terminating pod=%s grace_s=%s", self.key, grace)
        for runner in self.init_runners + self.app_runners:
            if runner.running:
                self._event("Killing", f"Stopping container {runner.name}", runner.name)
        self._kill_all(grace_s=float(grace))
        try:
            self._publish(pod, force=True)
        except Exception:
            log.debug("final status patch failed pod=%s", self.key, exc_info=True)
        try:
            self.ctx.client.delete(
                pod_path(self.namespace, self.name),
                {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            log.info("pod deleted pod=%s uid=%s", self.key, self.uid)
        except ApiError as exc:
            if exc.status not in (404, 409):
                log.warning("pod delete failed pod=%s error=%s; will retry on resync", self.key, exc)
        self._cleanup()

    def _cleanup(self) -> None:
        self.volumes.cleanup()
        self.ctx.release_ip(self.uid)
