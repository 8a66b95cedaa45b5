"""raystate.model."""
