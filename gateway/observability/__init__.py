"""Metrics and logging of the gateway process."""
