"""Decide from pod events when a worker instance is lost, once per loss.

A pod is lost when (first match wins):
- `failed`: its worker container exited or the pod turned Failed/Succeeded
  (restartPolicy Never: the instance cannot come back by itself);
- `deleted`: it is being deleted (deletionTimestamp set) or is gone;
- `not_ready`: it had been Ready, is Running, and has been NotReady for
  longer than the grace period (a hung or cut-off process the kubelet has
  not killed yet).

Invariants (tested):
- a pod's terminal loss (failed or deleted) is reported at most once, however
  many events repeat it, in whatever order they arrive;
- a NotReady episode is reported at most once, and only after the grace;
  becoming Ready again ends the episode, so a later one is reported again;
- a pod never seen Ready is never reported NotReady (it may still be starting);
- a deletion the operator asked for itself (scale down, rollout, teardown)
  is flagged `planned`, so the caller fails the peers' rooms without raising
  an alarm; and it is reported only once the pod has ended or is gone, not
  when the deletion starts: a worker asked to stop drains its in-flight
  requests first (their rooms must not be failed under it), and whatever is
  still open when it is gone is failed then.

`LossTracker` only updates its own table; the caller brings the clock and
acts on the verdicts. Pure module.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from pdcluster.operator.failover.pod_facts import PodFacts


class LossCause(StrEnum):
    failed = "failed"
    deleted = "deleted"
    not_ready = "not_ready"


@dataclass(frozen=True)
class Loss:
    pod: PodFacts
    cause: LossCause
    # When it happened according to the API (None: unknown), for detection latency.
    happened_at: float | None
    planned: bool = False

    def describe(self, grace_s: float) -> str:
        if self.cause == LossCause.failed:
            return f"pod {self.pod.name} exited"
        if self.cause == LossCause.deleted:
            return f"pod {self.pod.name} was deleted"
        return f"pod {self.pod.name} has not been Ready for {grace_s:g}s"


@dataclass(frozen=True)
class Verdict:
    loss: Loss | None = None
    # Observe the pod again at this time (a NotReady grace ends then).
    recheck_at: float | None = None


@dataclass
class _PodState:
    seen_ready: bool = False
    not_ready_since: float | None = None
    reported_not_ready: bool = False
    reported_terminal: bool = False


class LossTracker:
    def __init__(self, not_ready_grace_s: float, max_pods: int = 100_000) -> None:
        if not_ready_grace_s < 0:
            raise ValueError(f"not_ready_grace_s must be >= 0, got {not_ready_grace_s}")
        if max_pods < 1:
            raise ValueError(f"max_pods must be >= 1, got {max_pods}")
        self.not_ready_grace_s = not_ready_grace_s
        self._max_pods = max_pods
        self._pods: OrderedDict[str, _PodState] = OrderedDict()
        self._planned: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    def expect_deletion(self, uid: str) -> None:
        """The operator is deleting this pod itself (scale down, rollout, gang teardown)."""
        self._planned[uid] = None
        while len(self._planned) > self._max_pods:
            self._planned.popitem(last=False)

    def _state(self, uid: str) -> _PodState:
        state = self._pods.get(uid)
        if state is None:
            state = self._pods[uid] = _PodState()
            while len(self._pods) > self._max_pods:
                self._pods.popitem(last=False)
        return state

    def observe(self, pod: PodFacts, now: float, *, gone: bool = False) -> Verdict:
        """The latest object of `pod` (`gone`: from a DELETED event)."""
        state = self._state(pod.uid)
        if pod.ready and not (gone or pod.deleting or pod.has_ended):
            state.seen_ready = True
            state.not_ready_since = None
            state.reported_not_ready = False
            return Verdict()
        if gone or pod.has_ended:
            return self._terminal(pod, state)
        if pod.deleting:
            if pod.uid in self._planned:
                return Verdict()  # draining: reported when it has ended or is gone
            return self._terminal(pod, state)
        if not state.seen_ready or pod.phase != "Running":
            return Verdict()
        if state.not_ready_since is None:
            # The operator's own clock: the condition's time has whole seconds
            # and may come from another machine's clock.
            state.not_ready_since = now
        if state.reported_not_ready:
            return Verdict()
        due = state.not_ready_since + self.not_ready_grace_s
        if now < due:
            return Verdict(recheck_at=due)
        state.reported_not_ready = True
        return Verdict(Loss(pod, LossCause.not_ready, pod.ready_changed_at))

    def _terminal(self, pod: PodFacts, state: _PodState) -> Verdict:
        # The state outlives the pod (up to max_pods, oldest first out): a late
        # or replayed event about the same uid must not report it again.
        if state.reported_terminal:
            return Verdict()
        state.reported_terminal = True
        planned = pod.uid in self._planned
        self._planned.pop(pod.uid, None)
        if pod.has_ended:
            return Verdict(Loss(pod, LossCause.failed, pod.terminated_at, planned))
        return Verdict(Loss(pod, LossCause.deleted, pod.deletion_requested_at, planned))
