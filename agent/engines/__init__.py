"""weightsync.agent.engines"""
