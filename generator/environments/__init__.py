"""Environments for multi-turn rollouts (generator/multiturn.py): the interface and the built-in ones."""
