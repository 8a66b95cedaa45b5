"""raystate.scheduler."""
