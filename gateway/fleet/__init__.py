"""The replicas as the gateway believes them to be: their state and load, how they are discovered,
what the gateway predicts they cache, and which one owns a stored response."""
