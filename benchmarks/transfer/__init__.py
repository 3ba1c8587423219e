"""Transceiver throughput and latency against raw limits (`python -m benchmarks.transfer.throughput`)."""
