"""reward.py: not built yet (see the open issue for this stage)."""
