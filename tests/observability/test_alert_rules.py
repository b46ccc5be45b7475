"""The alerting rules: generated, valid for promtool, and unit-tested firing and quiet.

`promtool` is Debian's (`make test` installs it, `e2e/prometheus_tools.py`).
`alerts_test.yaml` holds the cases; here each alert must have one that
expects it firing and one that expects it quiet, and a runbook section in
docs/operations.md.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.prometheus_tools import ensure_tools
from pdcluster.operator.observability.alerts import build_rules, render_rule_file
from pdcluster.operator.observability.generate import RULES_FILE, generated_files

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("alerts_test.yaml")
ALERTS = [rule["alert"] for rule in build_rules()]


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = ensure_tools().promtool
    return subprocess.run([str(tool), *args], capture_output=True, text=True, timeout=120)


def test_every_generated_file_is_committed_as_generated() -> None:
    stale = [str(p) for p, text in generated_files().items() if (ROOT / p).read_text() != text]
    assert not stale, f"run `make crds`: {stale}"
    assert (ROOT / RULES_FILE).read_text() == render_rule_file()


def test_promtool_check_rules_accepts_the_rule_file() -> None:
    proc = promtool("check", "rules", str(ROOT / RULES_FILE))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests_pass() -> None:
    proc = promtool("test", "rules", str(CASES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_fail_when_an_alert_would_not_fire(tmp_path: Path) -> None:
    """The cases can fail: with every threshold made unreachable, promtool says so."""
    rules = yaml.safe_load((ROOT / RULES_FILE).read_text())
    for rule in rules["groups"][0]["rules"]:
        rule["expr"] = f"({rule['expr']}) and on() vector(0) > 1"
    broken = tmp_path / "rules.yaml"
    broken.write_text(yaml.safe_dump(rules))
    cases = yaml.safe_load(CASES.read_text())
    cases["rule_files"] = [str(broken)]
    (tmp_path / "cases.yaml").write_text(yaml.safe_dump(cases))
    proc = promtool("test", "rules", str(tmp_path / "cases.yaml"))
    assert proc.returncode != 0
    for alert in ALERTS:
        assert f"alertname: {alert}" in proc.stdout + proc.stderr, alert


def _cases_of(alert: str) -> tuple[int, int]:
    """(cases expecting `alert` firing, cases expecting it quiet)."""
    firing = quiet = 0
    for test in yaml.safe_load(CASES.read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            if case["alertname"] == alert:
                if case.get("exp_alerts"):
                    firing += 1
                else:
                    quiet += 1
    return firing, quiet


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_has_a_firing_and_a_quiet_case(alert: str) -> None:
    firing, quiet = _cases_of(alert)
    assert firing >= 1 and quiet >= 1, (alert, firing, quiet)


@pytest.mark.parametrize("alert", ALERTS)
def test_every_alert_has_a_runbook_section(alert: str) -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    assert f"### Alert: {alert}\n" in operations, alert
    rule = next(r for r in build_rules() if r["alert"] == alert)
    assert rule["annotations"]["runbook_url"] == f"docs/operations.md#alert-{alert.lower()}"
