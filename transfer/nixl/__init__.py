"""The NIXL transceiver: one agent per worker, registered pools, one-sided READs by descriptor."""
