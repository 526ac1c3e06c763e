"""The gateway package: the HTTP process that fronts every model worker."""
