"""The model worker package: one process per model replica, owning one engine (model, generator, cache)."""
