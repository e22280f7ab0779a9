"""The configuration defaults (`base.py`, every field documented) and the named variants (`grpo.py`)."""
