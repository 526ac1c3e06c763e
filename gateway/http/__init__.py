"""The HTTP layer of the gateway process: the Quart app, its routes, auth and request logging."""
