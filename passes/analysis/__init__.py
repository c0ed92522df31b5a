"""Read-only analyses over captured graphs: they decide, transforms apply."""
