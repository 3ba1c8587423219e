"""`disagg bench-transfer`: transceiver throughput and latency against raw limits."""
