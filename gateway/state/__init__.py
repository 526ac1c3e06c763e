"""State the gateway keeps across requests and restarts: stored Responses API responses."""
