"""warmpath protos."""
