"""weightsync.agent"""
