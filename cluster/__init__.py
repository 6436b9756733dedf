"""warmpath cluster."""
