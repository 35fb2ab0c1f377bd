"""Serving: an OpenAI-compatible HTTP server and a chat page over the inference engine."""
