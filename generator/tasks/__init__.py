"""Built-in tasks: prompts with a checkable answer, a held-out split and a scoring rule."""
