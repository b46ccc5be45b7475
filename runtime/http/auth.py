"""Who may call which worker endpoint: the cluster token as a Bearer header.

The worker data plane (`/generate`, `/abort_request`, `/v1/*`) and the
detailed server info (`/get_server_info`, `/server_info`: ZMQ endpoints,
peer addresses, counters) and the prefix-cache feed (`/prefix_cache/*`, what
the worker has cached) need `Authorization: Bearer <cluster token>`;
`/health`, `/health_generate`, `/model_info`, `/get_model_info` and
`/metrics` stay open and name no peer addresses. `/admin/*` checks the token
in its own handlers. A manifest may open the data plane for a PD router that
cannot send a key (`auth.workerApi: open`); the info stays guarded.

Missing header → 401, wrong token → 403; the comparison takes constant time.

Pure module.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

DATA_PLANE_PATHS = ("/generate", "/abort_request")
DATA_PLANE_PREFIXES = ("/v1/",)
INFO_PATHS = ("/get_server_info", "/server_info")
INFO_PREFIXES = ("/prefix_cache/",)


@dataclass(frozen=True)
class Denied:
    status: int  # 401 | 403
    message: str


def is_data_plane(path: str) -> bool:
    return path in DATA_PLANE_PATHS or path.startswith(DATA_PLANE_PREFIXES)


def is_guarded(path: str, *, data_plane_open: bool) -> bool:
    """Whether `path` needs the cluster token on a worker."""
    if path in INFO_PATHS or path.startswith(INFO_PREFIXES):
        return True
    return is_data_plane(path) and not data_plane_open


def check_bearer(header: str | None, token: str) -> Denied | None:
    """None when `header` carries `token`; why not otherwise."""
    if not header:
        return Denied(401, "missing Authorization: Bearer <cluster token>")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        presented.strip().encode(), token.encode()
    ):
        return Denied(403, "wrong cluster token")
    return None


def bearer_headers(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}
