"""The `grpo` command line, launchers and deployment configs."""
