"""Wire formats: subjects and msgspec events. Imports nothing of the engine."""
