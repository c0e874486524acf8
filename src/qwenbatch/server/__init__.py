"""The OpenAI-compatible HTTP server (needs the ``server`` extra)."""
