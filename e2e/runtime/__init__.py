"""weightsync.e2e.runtime"""
