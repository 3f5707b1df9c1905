"""The one YAML config: its pydantic schema (``schema/``, one module per section) and the loader that applies
CLI overrides and reports unknown keys by name (``loader``)."""
