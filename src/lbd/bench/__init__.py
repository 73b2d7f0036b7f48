"""`lbd bench`: a load generator for any OpenAI-compatible endpoint (no torch: it must stay light)."""
