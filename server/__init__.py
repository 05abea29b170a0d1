"""Front doors: the offline `LLM` API, the CLI (and, later, the HTTP server). All drive the same
scheduler loop (`scheduler.loop.EngineLoop`)."""
