"""Process-level helpers every layer may import (a leaf: it imports no
project package): ending asyncio tasks (`cancellation`) and taking the
start-up heap out of the cyclic collector (`startup_heap`)."""
