"""Top-level test configuration: the Kubernetes fixtures (`cluster`, `process_runtime`, `kube`,
`namespace`) from weightsync.e2e.pytest_plugin. A test that uses them is marked `cluster` automatically;
the control plane starts once per session, only if such a test is selected."""

pytest_plugins = ["weightsync.e2e.pytest_plugin"]
