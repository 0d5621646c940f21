"""``python -m dobb_bench.timing timing|payload ...``: the ``timing`` and ``payload`` commands
without the rest of the CLI (no training harness, no plotting of studies: a bare GPU machine with
torch only). The commands live in ``dobb_bench.cost.timing`` and ``dobb_bench.cost.payload_command``;
``dobb-bench timing`` / ``payload`` run the same code.
"""
from __future__ import annotations

import sys

from dobb_bench.cli import main

if __name__ == "__main__":
    sys.exit(main(modules=("cost.timing", "cost.payload_command")))
