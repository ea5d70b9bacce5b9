"""The search: ``ppotune search``, the ask/tell loop, its proposal policy and the pure decisions."""
