"""`attnserve bench serve`: a load sweep against OpenAI-compatible servers (`sweep` runs it)."""
