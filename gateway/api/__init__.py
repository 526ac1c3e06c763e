"""HTTP routes of the gateway process: OpenAI API, admin API, health endpoints."""
