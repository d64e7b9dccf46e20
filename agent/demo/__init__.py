"""weightsync.agent.demo"""
