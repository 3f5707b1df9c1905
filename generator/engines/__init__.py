"""Generation engines behind one small interface (see base.py): vLLM for GPUs, transformers for CPUs and tests."""
