"""The frontend: text tokens, a prompt recording's features, and the store of zero-shot voices."""
