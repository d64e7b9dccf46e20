"""Transfer: a version moved between agents (send, serve, fetch, relay, verify, digest)."""
