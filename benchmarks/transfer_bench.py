"""Transceiver benchmark: `python benchmarks/transfer_bench.py [--json]`.

The same as `disagg bench-transfer` / `python -m transfer.bench.throughput`; see
`transfer/bench/throughput.py` for what it measures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfer.bench.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
