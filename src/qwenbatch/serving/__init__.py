"""The OpenAI serving layer: protocol models and the chat, completions, rerank and score handlers.

Transport-independent: a handler takes a validated request object and its priority and returns a response
object, or an async iterator of chunks for a streaming request. The HTTP routes (server/), run-batch's
in-process backend and the Batch API worker (batch/) all call it; it sees the engine only through the
engine client (``engine.async_engine.AsyncEngine``).
"""
