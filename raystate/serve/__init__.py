"""raystate.serve."""
