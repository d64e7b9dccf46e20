"""weightsync.e2e.runtime: a kubelet stand-in that runs the pods of process nodes as host processes.

Public API: ProcessRuntime(kubeconfig, node_names, state_dir, python_bin_dir=None) with start(), stop()
and log_path(namespace, pod, container); CLI: python -m weightsync.e2e.runtime --kubeconfig K --nodes a,b
--state-dir D.
"""

from weightsync.e2e.runtime.runtime import ProcessRuntime

__all__ = ["ProcessRuntime"]
