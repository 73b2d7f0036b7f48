"""The OpenAI-compatible HTTP front end."""
