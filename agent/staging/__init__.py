"""Staging: the memory a version waits in between the trainer's publish and the transfer."""
