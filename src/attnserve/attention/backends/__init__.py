"""Backend implementations. Modules here import heavy packages only inside methods."""
