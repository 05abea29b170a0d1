"""Front doors: the offline `LLM` API, the CLI and the OpenAI-compatible HTTP server. All drive the same
scheduler loop (`scheduler.loop.EngineLoop`)."""
