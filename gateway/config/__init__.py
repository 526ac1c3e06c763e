"""Gateway configuration: the model registry, API keys, and GPU placement checks (gateway process)."""
