"""The OpenAI-compatible HTTP server (`kubeinfer serve`): FastAPI routes over the AsyncEngine."""
