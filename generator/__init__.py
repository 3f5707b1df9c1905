"""Generators: sample G completions per prompt, score them and upload grouped rollouts to the hub."""
