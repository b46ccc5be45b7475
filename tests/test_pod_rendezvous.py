"""How the pods of an instance meet (runtime/pod_rendezvous.py): the leader
address, the rank proofs (bound to the rendezvous's nonce) and the leader's
signed verdict, and which ranks a pod runs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdcluster.runtime.pod_layout import compute_pod_layout
from pdcluster.runtime.pod_rendezvous import (
    RankIdentity,
    RendezvousError,
    address_entry,
    check_fresh,
    check_verdict,
    compute_verdict,
    describe_missing,
    dp_leader_pods,
    group_hosts,
    groups_on_pod,
    missing_ranks,
    parse_leader_address,
    plan_pod,
    proof_entry,
    read_address_entry,
)

WHO = RankIdentity("demo", "prefill", 0)
TOKEN = "s3cret"
NONCE = "a" * 32
EARLIER = "b" * 32  # the nonce of an earlier rendezvous


def challenge(rank: int) -> str:
    return f"{rank:032x}"


def proofs_of(
    ranks: range, token: str = TOKEN, who: RankIdentity = WHO, nonce: str = NONCE
) -> dict[int, str]:
    return {r: proof_entry(token, who, r, nonce, challenge(r)) for r in ranks}


def admitted(verdict: str, ranks: range, entries: dict[int, str], nonce: str = NONCE) -> bool:
    """Whether a rank reading `verdict` joins (it checks the signature itself)."""
    try:
        check_verdict(TOKEN, WHO, ranks, entries, nonce, verdict)
    except RendezvousError:
        return False
    return True


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("10.1.2.3", "10.1.2.3"),
        (" 10.1.2.3\n", "10.1.2.3"),  # a downward-API file ends with what the annotation holds
        ("fd00::5", "fd00::5"),
        ("[fd00::5]", "fd00::5"),
        ("127.0.0.1", "127.0.0.1"),
        ("Leader-0.Pods.local", "leader-0.pods.local"),
    ],
)
def test_a_leader_address_is_one_host(text: str, host: str) -> None:
    assert parse_leader_address(text) == host


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("  \n", "empty"),
        ("http://10.1.2.3", "not a URL"),
        ("10.1.2.3 10.1.2.4", "not a URL"),
        ("10.1.2.3:29500", "without a port"),
        ("user@10.1.2.3", "not a URL"),
        ("-bad-.host", "neither an IP nor a host name"),
        ("a" * 254, "neither an IP nor a host name"),
    ],
)
def test_a_bad_leader_address_is_refused_with_the_reason(text: str, why: str) -> None:
    with pytest.raises(RendezvousError, match=why):
        parse_leader_address(text)


def test_every_rank_proving_the_token_is_admitted_by_a_signed_verdict() -> None:
    entries = proofs_of(range(4))
    verdict = compute_verdict(TOKEN, WHO, range(4), entries, NONCE)
    assert verdict.startswith("ok ") and admitted(verdict, range(4), entries)


def test_a_missing_proof_refuses_the_gang_and_names_the_rank() -> None:
    proofs = proofs_of(range(4))
    del proofs[2]
    verdict = compute_verdict(TOKEN, WHO, range(4), proofs, NONCE)
    assert verdict == "refused: no proof from rank 2"
    with pytest.raises(RendezvousError, match="leader refused this rank: refused: no proof"):
        check_verdict(TOKEN, WHO, range(4), proofs, NONCE, verdict)


def test_a_proof_from_an_earlier_rendezvous_is_refused() -> None:
    """Anyone reaching the store reads the proofs in it: one read in the last
    rendezvous answered another nonce."""
    entries = proofs_of(range(3))
    entries[1] = proofs_of(range(3), nonce=EARLIER)[1]
    verdict = compute_verdict(TOKEN, WHO, range(3), entries, NONCE)
    assert verdict.startswith("refused: rank 1 did not prove demo/prefill-0")
    assert verdict.endswith("in this rendezvous")


@pytest.mark.parametrize(
    "forged",
    [
        "ok",  # written by anyone
        "ok " + "0" * 64,
        "ok the-leader-said-so",
    ],
)
def test_a_rank_joins_only_on_an_ok_signed_over_this_rendezvous(forged: str) -> None:
    entries = proofs_of(range(2))
    assert not admitted(forged, range(2), entries)
    with pytest.raises(RendezvousError, match="not signed with this cluster's token"):
        check_verdict(TOKEN, WHO, range(2), entries, NONCE, forged)
    # A real "ok" of an earlier rendezvous (another nonce, other challenges).
    earlier = {r: proof_entry(TOKEN, WHO, r, EARLIER, f"{r + 7:032x}") for r in range(2)}
    old_ok = compute_verdict(TOKEN, WHO, range(2), earlier, EARLIER)
    assert old_ok.startswith("ok ") and not admitted(old_ok, range(2), entries)
    # Signed with another token.
    stranger = compute_verdict("other", WHO, range(2), proofs_of(range(2), token="other"), NONCE)
    assert stranger.startswith("ok ") and not admitted(stranger, range(2), entries)


@pytest.mark.parametrize("value", ["", "A" * 32, "a" * 31, "a" * 33, "g" * 32, "ok"])
def test_a_nonce_or_challenge_that_is_not_32_hex_digits_is_refused(value: str) -> None:
    with pytest.raises(RendezvousError, match="nonce in the store is not 32 hex digits"):
        check_fresh("nonce", value)
    assert check_fresh("nonce", NONCE) == NONCE


@pytest.mark.parametrize(
    "stranger",
    [
        (TOKEN + "x", WHO),  # another token
        (TOKEN, RankIdentity("other", "prefill", 0)),  # another cluster
        (TOKEN, RankIdentity("demo", "decode", 0)),  # another role
        (TOKEN, RankIdentity("demo", "prefill", 1)),  # another instance
    ],
)
def test_a_rank_of_another_cluster_role_instance_or_token_is_refused(
    stranger: tuple[str, RankIdentity],
) -> None:
    proofs = proofs_of(range(2))
    proofs[1] = proof_entry(stranger[0], stranger[1], 1, NONCE, challenge(1))
    verdict = compute_verdict(TOKEN, WHO, range(2), proofs, NONCE)
    assert verdict.startswith("refused: rank 1 did not prove demo/prefill-0")


def test_a_proof_copied_from_another_rank_is_refused() -> None:
    proofs = proofs_of(range(3))
    proofs[2] = proofs[1]
    verdict = compute_verdict(TOKEN, WHO, range(3), proofs, NONCE)
    assert verdict.startswith("refused: rank 2 ")


def test_a_dp_group_is_proved_with_global_ranks() -> None:
    # dp group 1 of tp 2 is the world of global ranks 2 and 3.
    entries = proofs_of(range(2, 4))
    assert admitted(compute_verdict(TOKEN, WHO, range(2, 4), entries, NONCE), range(2, 4), entries)
    shifted = {r + 2: p for r, p in proofs_of(range(2)).items()}
    verdict = compute_verdict(TOKEN, WHO, range(2, 4), shifted, NONCE)
    assert verdict.startswith("refused: ranks 2, 3")


@given(
    st.integers(1, 16),
    st.sets(st.integers(0, 20)),
    st.sets(st.integers(0, 20)),
)
def test_the_verdict_admits_exactly_when_every_rank_proved_this_rendezvous(
    n: int, present: set[int], stale: set[int]
) -> None:
    """`stale`: ranks whose entry was read in an earlier rendezvous."""
    entries = {
        r: proof_entry(TOKEN, WHO, r, EARLIER if r in stale else NONCE, challenge(r))
        for r in present
    }
    verdict = compute_verdict(TOKEN, WHO, range(n), entries, NONCE)
    every = set(range(n)).issubset(present) and not set(range(n)) & stale
    assert admitted(verdict, range(n), entries) == every
    assert verdict.startswith("ok ") == every
    assert missing_ranks(n, present) == sorted(set(range(n)) - present)


def test_the_leader_says_which_ranks_and_pods_it_waits_for() -> None:
    layout = compute_pod_layout(4, 1)
    assert describe_missing(layout, [2, 3]) == "ranks 2, 3 (pods 2, 3)"
    assert describe_missing(compute_pod_layout(4, 2), [2, 3]) == "ranks 2, 3 (pod 1)"
    assert describe_missing(layout, [1]) == "rank 1 (pod 1)"
    assert describe_missing(layout, []) == "no rank"


@pytest.mark.parametrize(
    ("ranks", "gpus", "pod", "expected", "leader"),
    [
        (2, None, 0, range(0, 2), True),  # gpusPerPod left out: one pod runs every rank
        (2, 1, 0, range(0, 1), True),
        (2, 1, 1, range(1, 2), False),
        (8, 4, 1, range(4, 8), False),
    ],
)
def test_a_pod_runs_its_rank_range(
    ranks: int, gpus: int | None, pod: int, expected: range, leader: bool
) -> None:
    plan = plan_pod(compute_pod_layout(ranks, gpus), dp=1, pod_index=pod)
    assert (plan.ranks, plan.is_leader) == (expected, leader)


def test_a_pod_index_outside_the_instance_is_refused() -> None:
    with pytest.raises(RendezvousError, match="pod index 2 is outside the instance's 2 pods"):
        plan_pod(compute_pod_layout(2, 1), dp=1, pod_index=2)
    with pytest.raises(RendezvousError, match="pod index -1"):
        plan_pod(compute_pod_layout(2, 1), dp=1, pod_index=-1)


@pytest.mark.parametrize(
    ("ranks", "dp", "gpus", "pod", "publishes", "needs"),
    [
        # dp2 tp1, one rank a pod: pod 1 leads dp group 1, the front needs its address.
        (2, 2, 1, 0, False, (1,)),
        (2, 2, 1, 1, True, ()),
        # dp2 tp2 over two pods of 2: a whole group a pod.
        (4, 2, 2, 0, False, (1,)),
        (4, 2, 2, 1, True, ()),
        # dp2 tp2, one rank a pod: pod 3 runs group 1's follower, led by pod 2.
        (4, 2, 1, 1, False, ()),
        (4, 2, 1, 2, True, ()),
        (4, 2, 1, 3, False, (2,)),
        (4, 2, 1, 0, False, (2,)),
        # dp4 tp1 over two pods of 2: pod 1 leads groups 2 and 3.
        (4, 4, 2, 0, False, (1,)),
        (4, 4, 2, 1, True, ()),
        # One pod: nothing to exchange, any dp.
        (4, 2, None, 0, False, ()),
    ],
)
def test_dp_groups_over_several_pods_exchange_the_addresses_they_need(
    ranks: int, dp: int, gpus: int | None, pod: int, publishes: bool, needs: tuple[int, ...]
) -> None:
    layout = compute_pod_layout(ranks, gpus)
    plan = plan_pod(layout, dp=dp, pod_index=pod)
    assert (plan.publishes, plan.needs) == (publishes, needs)
    assert plan.ranks == layout.rank_range(pod)


@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]))
def test_every_needed_address_is_published_and_every_group_is_reachable(
    dp: int, group: int, gpus: int
) -> None:
    ranks = dp * group
    if ranks % gpus or gpus > ranks:
        return
    layout = compute_pod_layout(ranks, gpus)
    plans = [plan_pod(layout, dp, k) for k in range(layout.num_pods)]
    published = {p.pod_index for p in plans if p.publishes}
    assert set(dp_leader_pods(layout, dp)) - {0} == published
    for p in plans:
        assert set(p.needs) <= published and p.pod_index not in p.needs
        known = {k: f"10.0.0.{k}" for k in p.needs}
        own = f"10.0.0.{p.pod_index}"
        hosts = group_hosts(layout, dp, p.pod_index, own, "10.0.0.0", known)
        for d, k in enumerate(dp_leader_pods(layout, dp)):
            if p.pod_index == 0 or d in groups_on_pod(layout, dp, p.pod_index):
                assert hosts[d] == f"10.0.0.{k}", (d, k, p)
            else:
                assert hosts[d] is None


def test_a_missing_address_is_named() -> None:
    layout = compute_pod_layout(2, 1)
    with pytest.raises(RendezvousError, match="address of pod 1 .leader of dp group 1. is unknown"):
        group_hosts(layout, 2, 0, "10.0.0.0", "10.0.0.0", {})


def test_an_address_entry_binds_the_host_to_the_pod_the_token_and_the_rendezvous() -> None:
    entry = address_entry(TOKEN, WHO, 1, "10.0.0.7", NONCE)
    assert read_address_entry(TOKEN, WHO, 1, entry, NONCE) == "10.0.0.7"
    with pytest.raises(RendezvousError, match="not published for demo/prefill-0"):
        read_address_entry("other-token", WHO, 1, entry, NONCE)
    with pytest.raises(RendezvousError, match="pod 2's address 10.0.0.7 was not published"):
        read_address_entry(TOKEN, WHO, 2, entry, NONCE)  # another pod's entry, copied
    with pytest.raises(RendezvousError, match="in this rendezvous"):
        read_address_entry(TOKEN, WHO, 1, entry, EARLIER)  # an earlier rendezvous's entry
    forged = entry.replace("10.0.0.7", "10.0.0.8")
    with pytest.raises(RendezvousError, match="not published"):
        read_address_entry(TOKEN, WHO, 1, forged, NONCE)
    with pytest.raises(RendezvousError, match="malformed"):
        read_address_entry(TOKEN, WHO, 1, "10.0.0.7", NONCE)
    with pytest.raises(RendezvousError, match="not a URL"):
        address_entry(TOKEN, WHO, 1, "http://10.0.0.7", NONCE)
