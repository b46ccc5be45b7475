"""The harness's own plumbing: build pins, certificates, process groups (no cluster)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e import cluster, pki, processes
from e2e.cluster import ClusterError, ClusterSettings
from e2e.controlplane import build
from e2e.nodeagent.kubeapi import KubeApi

KUBERNETES_GO_MOD_EXCERPT = """
module k8s.io/kubernetes

replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/cri-api => ./staging/src/k8s.io/cri-api
\tgithub.com/foo/bar => github.com/foo/bar v1.0.0
)
"""


@pytest.mark.parametrize(
    ("version", "tag"), [("v1.37.2", "v0.37.2"), ("v1.34.0", "v0.34.0"), ("v1.36.11", "v0.36.11")]
)
def test_staging_modules_take_the_matching_v0_tag(version: str, tag: str) -> None:
    assert build.staging_version(version) == tag


@pytest.mark.parametrize("version", ["1.37.2", "v1.37", "v2.0.0", "v1.37.2-rc.1", ""])
def test_non_release_versions_are_refused(version: str) -> None:
    with pytest.raises(ValueError, match="release tag"):
        build.staging_version(version)


def test_replace_list_is_generated_from_the_release_go_mod() -> None:
    modules = build.staging_modules(KUBERNETES_GO_MOD_EXCERPT)
    assert modules == ["k8s.io/api", "k8s.io/client-go", "k8s.io/cri-api"]
    go_mod = build.render_go_mod(modules, "v1.37.2")
    for module in modules:
        assert f"\t{module} => {module} v0.37.2\n" in go_mod
    assert "github.com/foo/bar" not in go_mod
    with pytest.raises(ValueError, match="no ./staging/src replace"):
        build.staging_modules("module example.com/other\n")


def test_committed_go_mod_maps_every_staging_module_to_the_pinned_release() -> None:
    go_mod = (build.MODULE_DIR / "go.mod").read_text()
    assert f"k8s.io/kubernetes {build.KUBERNETES_VERSION}" in go_mod
    replaced = re.findall(r"^\t(k8s\.io/\S+) => \1 (v\S+)$", go_mod, flags=re.M)
    assert len(replaced) >= 30
    assert {tag for _, tag in replaced} == {build.staging_version(build.KUBERNETES_VERSION)}


def test_ldflags_stamp_the_versions_that_version_endpoints_report() -> None:
    flags = build.compute_ldflags("v1.37.2", "v3.22.0", "2026-01-01T00:00:00Z")
    assert "-X 'k8s.io/component-base/version.gitVersion=v1.37.2'" in flags
    assert "-X 'k8s.io/client-go/pkg/version.gitMinor=37'" in flags
    assert "-X helm.sh/helm/v3/internal/version.version=v3.22.0" in flags
    assert flags.startswith("-s -w")


def test_cache_key_changes_with_the_pin_and_nothing_else() -> None:
    pinned = {"go.mod": b"a", "go.sum": b"b"}
    key = build.compute_cache_key(pinned, "go1.26.8")
    assert key == build.compute_cache_key(dict(pinned), "go1.26.8")
    assert key != build.compute_cache_key({**pinned, "go.sum": b"c"}, "go1.26.8")
    assert key != build.compute_cache_key(pinned, "go1.27.0")


def test_pki_serving_certificate_verifies_against_the_ca(tmp_path: Path) -> None:
    made = pki.make_pki(tmp_path)
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(made.ca_cert), str(made.serving_cert)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-in", str(made.serving_cert), "-noout", "-text"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:kubernetes.default.svc" in text
    assert made.sa_key.stat().st_mode & 0o077 == 0  # private keys are not world-readable


def test_token_file_and_kubeconfig_round_trip(tmp_path: Path) -> None:
    identities = pki.make_identities()
    lines = pki.render_token_file(identities).splitlines()
    assert len(lines) == len(identities)
    assert len({identity.token for identity in identities.values()}) == len(identities)
    admin = identities["admin"]
    assert f'{admin.token},pdcluster-admin,pdcluster-admin,"system:masters"' in lines
    ca = pki.make_pki(tmp_path / "pki").ca_cert
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        pki.render_kubeconfig("https://127.0.0.1:6443", ca, admin.user, admin.token)
    )
    client = KubeApi.from_kubeconfig(kubeconfig)
    assert (client.server, client.token, client.ca_file) == (
        "https://127.0.0.1:6443",
        admin.token,
        ca,
    )
    client.close()


def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    # The leader starts a grandchild that ignores SIGTERM: only the group SIGKILL ends it.
    script = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); "
        "time.sleep(60)"
    )
    proc, record = processes.spawn("tree", [sys.executable, "-c", script], tmp_path / "log")
    processes.wait_until(
        lambda: len(_group_members(record.pid)) == 2, 10, "the grandchild to start"
    )
    members = _group_members(record.pid)
    started = time.monotonic()
    processes.stop(record, grace_s=1.0)
    assert time.monotonic() - started < 5
    processes.wait_until(
        lambda: all(processes.process_start_ticks(pid) is None for pid in members), 5, "group gone"
    )
    assert proc.returncode is not None


def test_a_recycled_pid_is_not_signalled(tmp_path: Path) -> None:
    proc, record = processes.spawn("short", [sys.executable, "-c", "pass"], tmp_path / "log")
    proc.wait()
    processes.reap(record.pid)
    stale = processes.ProcessRecord("other", record.pid, record.start_ticks + 1)
    assert not processes.is_alive(stale)
    assert processes.signal_group(stale, 9) is False


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_up_and_down_refuse_a_folder_that_is_not_a_cluster_state(tmp_path: Path) -> None:
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    with pytest.raises(ClusterError, match="not a cluster state folder"):
        cluster.up(ClusterSettings(state_dir=tmp_path))
    with pytest.raises(ClusterError, match="not a cluster state folder"):
        cluster.down(tmp_path)
    assert precious.read_text() == "keep me"


def test_cluster_settings_refuse_impossible_node_counts() -> None:
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSettings(num_nodes=0)
