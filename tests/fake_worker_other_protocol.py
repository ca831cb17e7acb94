"""A fake worker (for tests): it answers the harness's handshake as a worker of another protocol
version would, then exits. Started as `python fake_worker_other_protocol.py <real start script>`."""

import json
import sys

MAGIC = "@@infer-bench@@ "

for line in sys.stdin:
    if line.startswith(MAGIC):
        print(MAGIC + json.dumps({"type": "Ready", "protocol": 0, "python": sys.executable, "pid": 1,
                                  "versions": {}}), flush=True)
        break
