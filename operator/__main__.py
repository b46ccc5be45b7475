"""`python -m pdcluster.operator [kopf run options]` — run the operator.

Runs `kopf run --standalone -m pdcluster.operator.handlers` with the given
options; without a namespace option it watches all namespaces. Settings of
the operator itself come from the environment (see settings.py).
"""

from __future__ import annotations

import sys

HANDLERS_MODULE = "pdcluster.operator.handlers"
_NAMESPACE_FLAGS = ("-n", "--namespace", "-A", "--all-namespaces")


def build_kopf_args(argv: list[str]) -> list[str]:
    args = ["run", "--standalone", "-m", HANDLERS_MODULE]
    if not any(a == f or a.startswith(f"{f}=") for a in argv for f in _NAMESPACE_FLAGS):
        args.append("--all-namespaces")
    return args + argv


def main(argv: list[str] | None = None) -> None:
    from kopf.cli import main as kopf_main

    kopf_main(args=build_kopf_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
