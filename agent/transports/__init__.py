"""weightsync.agent.transports"""
