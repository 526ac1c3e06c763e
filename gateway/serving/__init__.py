"""The serving layer of the gateway process: the request owner, the router and the worker link."""
