"""checkov (`--framework kubernetes`) over what a deployment applies: the Helm
chart as `helm template` renders it, and `pdcluster render` of every example.

Zero findings are allowed except the checks `checkov_skips.yaml` lists, each
with its reason. Each group of objects is one checkov run (seconds).
"""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdcluster.operator.render import render_yaml
from tests.operator.test_chart import CHART, HELM, needs_helm

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
SKIPS = yaml.safe_load((Path(__file__).with_name("checkov_skips.yaml")).read_text())
CHECKOV = Path(sys.executable).with_name("checkov")
NAMESPACE = "pdc-apps"
# The checks the review asked for: each must run on every group (and pass, but where allowed).
REQUIRED = {
    "CKV_K8S_10": "CPU requests",
    "CKV_K8S_12": "memory requests",
    "CKV_K8S_16": "privileged",
    "CKV_K8S_20": "allowPrivilegeEscalation",
    "CKV_K8S_22": "read-only root file system",
    "CKV_K8S_23": "root containers",
    "CKV_K8S_28": "NET_RAW",
    "CKV_K8S_29": "pod security context",
    "CKV_K8S_30": "container security context",
    "CKV_K8S_31": "seccomp",
    "CKV_K8S_35": "secrets as files",
    "CKV_K8S_37": "capabilities",
    "CKV_K8S_38": "service-account tokens",
    "CKV_K8S_40": "high UID",
}


def test_every_skip_has_a_one_line_reason() -> None:
    reasons = list(SKIPS["skip"].values())
    reasons += [a["reason"] for a in SKIPS["allow"]]
    assert reasons and all(isinstance(r, str) and r.strip() and "\n" not in r for r in reasons)


def allowed(finding: dict[str, Any]) -> bool:
    kind, _, rest = str(finding["resource"]).partition(".")
    name = rest.partition(".")[2]
    return any(
        a["check"] == finding["check_id"] and a["kind"] == kind and fnmatch.fnmatch(name, a["name"])
        for a in SKIPS["allow"]
    )


def checkov_findings(folder: Path) -> list[str]:
    skipped = ",".join(SKIPS["skip"])
    run = subprocess.run(
        [str(CHECKOV), "-d", str(folder), "--framework", "kubernetes", "--compact"]
        + ["-o", "json", "--skip-check", skipped],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode in (0, 1), run.stderr
    reports = json.loads(run.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    ran = {
        f["check_id"]
        for r in reports
        for outcome in ("passed_checks", "failed_checks")
        for f in r["results"][outcome]
    }
    assert ran >= REQUIRED.keys(), f"did not run: {sorted(REQUIRED.keys() - ran)}"
    return sorted(
        f"{f['check_id']} {f['check_name']}: {f['resource']} ({Path(f['file_path']).name})"
        for r in reports
        for f in r["results"]["failed_checks"]
        if not allowed(f)
    )


def test_rendered_examples_pass_checkov(tmp_path: Path) -> None:
    assert EXAMPLES
    for example in EXAMPLES:
        text = render_yaml(yaml.safe_load(example.read_text()), NAMESPACE)
        (tmp_path / example.name).write_text(text)
    assert checkov_findings(tmp_path) == []


@needs_helm
def test_helm_chart_passes_checkov(tmp_path: Path) -> None:
    assert HELM is not None
    out = subprocess.run(
        [HELM, "template", "rel", str(CHART), "-n", "pdc-system"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    (tmp_path / "chart.yaml").write_text(out)
    assert checkov_findings(tmp_path) == []


@pytest.mark.parametrize("check", ["CKV_K8S_38", "CKV_K8S_25"])
def test_allowances_do_not_cover_worker_pods(check: str) -> None:
    pod = {"check_id": check, "resource": "Pod.pdc-apps.pd-1p1d-prefill-0-abc-0"}
    assert not allowed(pod)
