"""A farm with one demo adapter (older trees refuse none) and extra replica flags, up until SIGTERM or Ctrl-C: the same
driver for trees whose `lorafarm up` has no replica-flag option (the before/after comparison of
benchmarks/cold_path_e2e.sh starts one from an old commit's tree and one from this tree).

    PYTHONPATH=<tree> python benchmarks/e2e_farm.py STATE_DIR REPLICAS [REPLICA_FLAG ...]

It uses only `lorafarm.farm.Farm(state_dir, replicas, ports, demo_adapters, replica_args)`,
`FarmPorts.free()`, `up()` and `stop()`; farm.json is written to STATE_DIR once the farm is up.
"""

import signal
import sys
from pathlib import Path

from lorafarm.farm import Farm, FarmPorts


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-4], file=sys.stderr)
        return 2
    state, replicas, replica_args = Path(argv[0]), int(argv[1]), argv[2:]
    farm = Farm(state, replicas=replicas, ports=FarmPorts.free(replicas), demo_adapters=1,
                replica_args=replica_args, progress=True)  # fmt: skip

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        farm.up()
        print(f"farm.json: {farm.farm_json}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        farm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
