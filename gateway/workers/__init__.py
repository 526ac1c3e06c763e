"""Worker lifecycle in the gateway process: local worker supervision and remote worker membership."""
