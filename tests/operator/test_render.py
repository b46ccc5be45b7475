"""`pdcluster render`: every object the operator would create for a manifest,
as multi-document YAML built by the operator's own builders."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pdcluster.operator.builders import build_desired
from pdcluster.operator.render import PLACEHOLDER_UID, cluster_for_render
from pdcluster.runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pd-1p1d.yaml"


def render(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict]:
    assert main(["render", *args]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_render_prints_every_object_of_the_cluster(capsys, tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["decode"]["replicas"] = 2
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    objects = render(capsys, "-f", str(manifest), "--namespace", "team-b")
    name = doc["metadata"]["name"]
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert kinds[:11] == [
        ("ServiceAccount", f"{name}-runtime"),
        ("Role", f"{name}-runtime"),
        ("RoleBinding", f"{name}-runtime"),
        ("NetworkPolicy", f"{name}-workers-ingress"),
        ("NetworkPolicy", f"{name}-router-ingress"),
        ("PodDisruptionBudget", f"{name}-prefill-budget"),
        ("PodDisruptionBudget", f"{name}-decode-budget"),
        ("PodDisruptionBudget", f"{name}-router-budget"),
        ("ConfigMap", f"{name}-config"),
        ("Secret", f"{name}-token"),
        ("Deployment", f"{name}-router"),
    ]
    pods = [o for o in objects if o["kind"] == "Pod"]
    roles = sorted(p["metadata"]["labels"]["pdcluster.io/role"] for p in pods)
    assert roles == ["decode", "decode", "prefill"]
    assert sum(o["kind"] == "Service" for o in objects) == 2  # router + prefill bootstrap
    assert {o["metadata"]["namespace"] for o in objects} == {"team-b"}
    # What the builders produce for the same cluster, object for object.
    cluster = cluster_for_render(doc, "team-b")
    desired = build_desired(cluster)
    built = [*desired.objects]
    for role in desired.roles:
        for index in range(role.replicas):
            instance = desired.instance(role.role, index)
            built += [*instance.pods, *filter(None, [instance.bootstrap_service])]
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    assert len(by_key) == len(objects) == len(built) + 1  # + the token Secret
    for obj in built:
        assert by_key[(obj["kind"], obj["metadata"]["name"])] == obj


def test_the_token_secret_is_shown_without_a_token(capsys) -> None:
    objects = render(capsys, "-f", str(EXAMPLE))
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert "data" not in secret and "stringData" not in secret
    owners = {o["metadata"]["ownerReferences"][0]["uid"] for o in objects}
    assert owners == {PLACEHOLDER_UID}
    assert {o["metadata"]["namespace"] for o in objects} == {"default"}


def test_a_users_own_token_secret_is_not_rendered(capsys, tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["auth"] = {"tokenSecretName": "mine"}
    manifest = tmp_path / "m.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    assert not [o for o in render(capsys, "-f", str(manifest)) if o["kind"] == "Secret"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("kind: Deployment\nmetadata: {name: x}\n", "expected PDCluster"),
        ("- a\n- b\n", "not a YAML mapping"),
        ("kind: PDCluster\nspec: {}\n", "no metadata"),
        ("kind: PDCluster\nmetadata: {name: x}\nspec: {prefill: {replicas: -1}}\n", "replicas"),
        ("kind: PDCluster\nmetadata: {name: x}\nspec:\n  prefill: {resources: {limit: {}}}\n"
         "  decode: {}\n", "unknown keys"),
        ("kind: [unclosed\n", "is not YAML"),
    ],
)  # fmt: skip
def test_bad_manifests_get_a_clear_error(capsys, tmp_path: Path, text: str, words: str) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(text)
    with pytest.raises(SystemExit) as err:
        main(["render", "-f", str(manifest)])
    assert "pdcluster render" in str(err.value) and words in str(err.value)
    assert capsys.readouterr().out == ""


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="cannot read"):
        main(["render", "-f", str(tmp_path / "absent.yaml")])
