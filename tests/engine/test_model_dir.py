"""The folder a worker loads, from every kind of model source; a Hugging Face
cache made here in the hub's own layout is read like a downloaded one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.runtime.engine.model_dir import ModelDirError, resolve_model_dir
from pdcluster.runtime.engine.model_fetch import fetch_hf_model
from pdcluster.runtime.engine.weights import load_hf_config
from pdcluster.runtime.spec import ModelSpec

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CONFIG = (
    '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,'
    ' "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,'
    ' "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6}'
)


def hub_cache(root: Path, repo: str = "org/llama", ref: str = "main") -> Path:
    """A hub cache as the hub library lays it out: blobs, a snapshot of links, a ref."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True)
    (repo_dir / "blobs" / "cfgblob").write_text(CONFIG)
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/cfgblob")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(COMMIT)
    return snapshot


def spec(uri: str | None = None, **model: object) -> ModelSpec:
    source = {"uri": uri, "cacheClaim": "c"} if uri and uri.startswith("hf://") else {"uri": uri}
    return ModelSpec.model_validate(
        {"name": "llama", **({"source": source} if uri else {}), **model}
    )


@pytest.mark.parametrize("revision", ["", "@main", f"@{COMMIT}"])
def test_an_hf_source_reads_the_snapshot_its_revision_names(tmp_path: Path, revision: str) -> None:
    snapshot = hub_cache(tmp_path)
    folder = resolve_model_dir(spec(f"hf://org/llama{revision}"), {"HF_HUB_CACHE": str(tmp_path)})
    assert folder == str(snapshot)
    # Our loader reads the model's config through the snapshot's links.
    assert load_hf_config(folder).num_layers == 2


def test_the_cache_defaults_to_the_hubs_own_places(tmp_path: Path) -> None:
    hub_cache(tmp_path / "hf" / "hub")
    assert resolve_model_dir(spec("hf://org/llama"), {"HF_HOME": str(tmp_path / "hf")})
    hub_cache(tmp_path / ".cache" / "huggingface" / "hub", repo="org/other")
    assert resolve_model_dir(spec("hf://org/other"), {"HOME": str(tmp_path)})


@pytest.mark.parametrize(
    ("uri", "phrase"),
    [
        ("hf://org/missing", "does not exist (not downloaded)"),
        ("hf://org/llama@v2", "cannot read"),
    ],
)
def test_a_model_missing_from_the_cache_names_the_source(
    tmp_path: Path, uri: str, phrase: str
) -> None:
    hub_cache(tmp_path)
    with pytest.raises(ModelDirError, match=re.escape(phrase)) as err:
        resolve_model_dir(spec(uri), {"HF_HUB_CACHE": str(tmp_path)})
    assert uri.split("@")[0] in str(err.value)


def test_a_mounted_source_is_read_where_the_pod_mounted_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(CONFIG)
    env = {"PDCLUSTER_MODEL_DIR": str(tmp_path)}
    assert resolve_model_dir(spec("pvc://models/llama"), env) == str(tmp_path)
    with pytest.raises(ModelDirError, match=r"pvc://models/llama: .*config.json does not exist"):
        resolve_model_dir(spec("pvc://models/llama"), {"PDCLUSTER_MODEL_DIR": str(tmp_path / "x")})
    # Outside Kubernetes: host:// is the folder itself; pvc:// has no mount.
    assert resolve_model_dir(spec(f"host://{tmp_path}"), {}) == str(tmp_path)
    with pytest.raises(ModelDirError, match="mounted by Kubernetes"):
        resolve_model_dir(spec("pvc://models/llama"), {})


def test_tiny_and_a_plain_path_need_no_source() -> None:
    assert resolve_model_dir(ModelSpec(), {}) == "tiny"
    assert resolve_model_dir(spec(path="/m"), {}) == "/m"


def test_fetch_model_offline_checks_what_the_cache_holds(tmp_path: Path) -> None:
    snapshot = hub_cache(tmp_path)
    assert fetch_hf_model("hf://org/llama", tmp_path, None, offline=True) == snapshot
    run = subprocess.run(
        [sys.executable, "-m", "pdcluster.runtime.cli", "fetch-model", "hf://org/gone"]
        + ["--cache", str(tmp_path)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    assert "model source hf://org/gone@main" in run.stderr and "not downloaded" in run.stderr
