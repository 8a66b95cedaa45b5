"""raystate.worker."""
