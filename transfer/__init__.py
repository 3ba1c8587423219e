"""Moving request caches between workers: one interface, a Python (TCP) and a NIXL backend.

Workers call `transfer.factory.create_transceiver`; the interface and
`TransferHandle` live in `transfer.base`, the errors in `transfer.errors`.
"""
