"""weightsync.operator"""
