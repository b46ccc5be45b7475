"""Worker HTTP server: API models, engine thread bridge, response shapes."""
