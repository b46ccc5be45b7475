"""Decide when a prefill worker has stayed unregistered too long (a Warning Event).

A prefill worker answers `/health` 503 with reason `unregistered: n/m
ranks registered` (or `bootstrap_rejected: ...`) until every rank of its
instance is registered with the instance's bootstrap server (runtime
`pd/readiness.py`). A short spell is normal start-up; one longer than
`warn_after_s` is a registration problem the user must see.

Invariants (tested):
- one Warning per unregistered episode of a pod, and only once it lasted
  `warn_after_s`;
- an answer with another reason, or a healthy one, ends the episode (a
  later episode warns again); no answer at all (`None`) changes nothing;
- a pod that is gone is forgotten (`retain`).

`RegistrationWatch` only updates its own table; the caller brings the
clock, the answers and performs the Events. Pure module.
"""

from __future__ import annotations

from dataclasses import dataclass

REGISTRATION_REASONS = ("unregistered", "bootstrap_rejected")


def is_registration_problem(reason: str | None) -> bool:
    """Whether a `/health` reason says the instance's ranks are not all registered."""
    return reason is not None and reason.split(":", 1)[0] in REGISTRATION_REASONS


@dataclass(frozen=True)
class Unregistered:
    uid: str
    pod: str
    reason: str
    since_s: float  # how long the episode has lasted

    def message(self) -> str:
        """Stable across repeats of one condition, so the Events aggregate."""
        return (
            f"prefill pod {self.pod} is not serving: {self.reason} "
            f"(for over {self.since_s:.0f}s); check its logs and the bootstrap server"
        )


@dataclass
class _Episode:
    since: float
    warned: bool = False


class RegistrationWatch:
    def __init__(self, warn_after_s: float) -> None:
        if not warn_after_s >= 0:
            raise ValueError(f"warn_after_s must be >= 0, got {warn_after_s}")
        self.warn_after_s = warn_after_s
        self._episodes: dict[str, _Episode] = {}

    def observe(
        self, uid: str, pod: str, reason: str | None, answered: bool, now: float
    ) -> Unregistered | None:
        """One `/health` answer (`answered=False`: no answer); returns a Warning to emit, if any."""
        if not answered:
            return None
        if not is_registration_problem(reason):
            self._episodes.pop(uid, None)
            return None
        assert reason is not None
        episode = self._episodes.setdefault(uid, _Episode(now))
        lasted = now - episode.since
        if episode.warned or lasted < self.warn_after_s:
            return None
        episode.warned = True
        return Unregistered(uid, pod, reason, self.warn_after_s)

    def retain(self, uids: set[str]) -> None:
        """Forget pods that are gone."""
        for uid in list(self._episodes):
            if uid not in uids:
                del self._episodes[uid]
