"""The WeightSyncJob API: pydantic models (the single source of truth for the CRD) and the contract
shared by the operator and the agent."""
