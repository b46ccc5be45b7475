"""Write the dashboards and the alerting rules where the chart and the docs read them.

    python -m pdcluster.operator.observability.generate [--root .]

`make crds` runs it; a test fails when a committed file differs from a fresh
generation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pdcluster.operator.observability.alerts import render_rule_file
from pdcluster.operator.observability.dashboards import render_dashboard
from pdcluster.operator.observability.panels import DASHBOARDS

CHART = Path("charts/pdcluster-operator")
RULES_FILE = CHART / "rules" / "pdcluster.rules.yaml"
DASHBOARD_DIRS = (CHART / "dashboards", Path("docs/dashboards"))


def generated_files() -> dict[Path, str]:
    """Path (relative to the repository) → content of every generated file."""
    files = {RULES_FILE: render_rule_file()}
    for uid in DASHBOARDS:
        text = render_dashboard(uid)
        for folder in DASHBOARD_DIRS:
            files[folder / f"{uid}.json"] = text
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    for path, text in generated_files().items():
        target = args.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
