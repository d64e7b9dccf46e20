"""Wire: the agent's channels (agent<->agent link and protocol, app<->agent Unix socket, admission limits)."""
