"""warmpath serve_apps."""
