"""Batch jobs: OpenAI Batch files in, results out, resumable."""
