"""Inference: the agent's engine side (what it knows of its engine) and the loop that fetches each target version and loads it."""
