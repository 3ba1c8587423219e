"""The OpenAI-compatible HTTP face: routes, request preparation, OpenAI shapes and errors."""
