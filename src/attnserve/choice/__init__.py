"""Which attention backend and kernel run, and why: the registry of every backend SGLang knows (`registry`),
the selection rules and their trace (`selection`), the measured fallback order (`measured`, `ranking`) and the
tuned results (`tuned`). It builds the runtime's backends (`registry.build_backend`); the runtime imports
nothing of it."""
