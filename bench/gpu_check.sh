#!/usr/bin/env bash
# GPU check of the nixl backend, on one GPU, no network, installs nothing (< 8 min).
#
#   bash bench/gpu_check.sh            # from the repository root, with .venv set up
#
# 1. engine on cuda, bfloat16, TP1: PD == colocated on 1P1D with nixl between two
#    processes on the one GPU (UCX CUDA IPC), KV pools registered as VRAM;
# 2. bench/kv_transfer.py --device cuda: nixl / raw NIXL next to a device-to-device copy.
# Prints what UCX negotiated. Exits non-zero, naming it, when a package or the GPU is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}

$PY - <<'PYCHECK'
import importlib, sys
missing = [m for m in ("torch", "nixl._api") if importlib.util.find_spec(m.split(".")[0]) is None]
if missing:
    sys.exit(f"gpu_check: missing packages: {missing}; install '.[dev,nixl]' first")
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
print("gpu:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PYCHECK

echo "== 1. PD (nixl, cuda, bfloat16) == colocated on 1P1D"
timeout 300 $PY - "$OUT" <<'PYPD'
import sys, time, random
from pathlib import Path
import httpx, yaml
sys.path.insert(0, ".")
from pdcluster.runtime.cli import load_manifest
from tests.local.cluster import local_cluster
from tests.pd_integration.reference import colocated_outputs

out = Path(sys.argv[1])
doc = yaml.safe_load(Path("examples/pd-1p1d-nixl.yaml").read_text())
doc["spec"]["model"] = {"name": "tiny", "computeDtype": "bfloat16"}
doc["spec"]["kvCache"]["dtype"] = "bfloat16"
for role in ("prefill", "decode"):
    doc["spec"][role].setdefault("engine", {})["device"] = "cuda"
path = out / "pd-1p1d-nixl-cuda.yaml"
path.write_text(yaml.safe_dump(doc))
rng = random.Random(3)
prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (1, 16, 17, 300, 2000)]
expected = colocated_outputs(load_manifest(str(path)), prompts, 8)
with local_cluster(path, out / "state") as cluster:
    got = []
    for p in prompts:
        r = httpx.post(cluster.endpoint + "/generate", timeout=120, json={
            "input_ids": p,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
        r.raise_for_status()
        got.append(r.json()["output_ids"])
    for proc in cluster.state["processes"]:
        if proc["role"] == "prefill":
            info = httpx.get(proc["url"] + "/get_server_info", headers=cluster.auth).json()
            print("negotiated:", info["kv_transport"])
assert got == expected, f"PD {got} != colocated {expected}"
print("PD == colocated:", len(prompts), "prompts")
PYPD

echo "== 2. kv_transfer on cuda"
timeout 300 $PY bench/kv_transfer.py --device cuda --sizes 1,16,256 --repeats 3 --json "$OUT/kv_transfer_cuda.json"
echo "results in $OUT"
