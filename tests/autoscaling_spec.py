"""The prefill autoscaling block of the scale-up-and-back-down tests, in local mode
(`tests/local/test_autoscale_up.py`) and on Kubernetes (`e2e/test_operator.py`): one
load step lifts prefill 1 -> 2 at once, and the load gone brings it back after a
short scale-down window."""

from __future__ import annotations

from typing import Any

# Any finished request takes longer than this to its first token: load above target.
TTFT_TARGET_S = 0.001
PREFILL_AUTOSCALING: dict[str, Any] = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "intervalSeconds": 1,
    "target": {"metric": "ttftP90Seconds", "value": TTFT_TARGET_S},
    "scaleUp": {"stabilizationSeconds": 0},
    "scaleDown": {"stabilizationSeconds": 3},
}
