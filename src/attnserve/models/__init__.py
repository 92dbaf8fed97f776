"""Model definitions (Llama family, DeepSeek MLA) and their loaders; see loader.py for the API."""
