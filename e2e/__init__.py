"""weightsync.e2e"""
