"""`attnserve serve` as a user runs it (the CLI's whole path), with the engine's forward pass replaced by
`server_helpers.stub_steps_at_gpu_rates`: `python tests/stub_serve.py [serve flags]`."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from server_helpers import stub_steps_at_gpu_rates

from attnserve import cli
from attnserve.server import engine_owner

if __name__ == "__main__":
    start = engine_owner.EngineProcess.start
    engine_owner.EngineProcess.start = staticmethod(lambda config, setup=None: start(config, stub_steps_at_gpu_rates))
    sys.exit(cli.main(["serve", *sys.argv[1:]]))
