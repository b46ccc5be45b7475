"""`pdcluster render -f FILE [--namespace NS]`: print every object the
operator would create for a manifest (see render.py).

The runtime's command line never imports the operator; it offers the
commands registered under the entry-point group `pdcluster.commands`
(pyproject.toml), and this module is the one the operator registers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def cmd_render(args: argparse.Namespace) -> int:
    from pdcluster.operator.builders.meta import BuildError
    from pdcluster.operator.render import RenderError, render_yaml

    try:
        doc = yaml.safe_load(Path(args.file).read_text())
    except OSError as err:
        raise SystemExit(f"pdcluster render: cannot read {args.file}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise SystemExit(f"pdcluster render: {args.file} is not YAML: {err}") from None
    try:
        text = render_yaml(doc, args.namespace or None)
    except (RenderError, BuildError) as err:
        raise SystemExit(f"pdcluster render: {args.file}: {err}") from None
    sys.stdout.write(text)
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    r = sub.add_parser(
        "render", help="print the Kubernetes objects the operator would create for a manifest"
    )
    r.add_argument("-f", "--file", required=True)
    r.add_argument("--namespace", default="", help="namespace (default: the manifest's)")
    r.set_defaults(fn=cmd_render)
