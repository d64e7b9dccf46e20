"""weightsync: declarative weight synchronisation from RL trainers to inference engines on Kubernetes."""

__version__ = "0.1.0"
