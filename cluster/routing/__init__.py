"""The router: worker pool and policies, polling, the context call and the worker event channel."""
