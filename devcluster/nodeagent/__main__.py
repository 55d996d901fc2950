"""`python -m kubeinfer.devcluster.nodeagent --config .cache/dev/agent.json` (run by dev up)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kubeinfer.devcluster.config import AgentConfig
from kubeinfer.devcluster.nodeagent.agent import NodeAgent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="agent.json written by dev up")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args()
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    for noisy in ("urllib3", "httpx"):  # a line per probe and per watch reconnect
        logging.getLogger(noisy).setLevel(logging.WARNING)
    NodeAgent(AgentConfig.model_validate_json(args.config.read_text())).run()


if __name__ == "__main__":
    main()
