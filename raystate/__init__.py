"""raystate: serving for hybrid-attention LLMs."""
