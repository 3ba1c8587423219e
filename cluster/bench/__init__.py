"""`disagg bench`: a load generator for any OpenAI-compatible endpoint, its statistics and plot."""
