#!/usr/bin/env bash
# GPU check of the engine and the transfer backends, on one GPU, no network,
# installs nothing (< 12 min).
#
#   bash bench/gpu_check.sh                       # from the repository root, with .venv set up
#   PY=python3 bash bench/gpu_check.sh            # another interpreter with the packages
#   GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh  # the same plumbing on a machine with no GPU
#
# 1. the tests marked `gpu` (engine on cuda against the CPU, tcp/shm/nixl from
#    device pools, bit for bit);
# 2. engine on cuda, bfloat16, TP1: PD == colocated on 1P1D with nixl between two
#    processes on the one GPU (UCX CUDA IPC), KV pools registered as VRAM;
#    prints what the prefill worker negotiated;
# 3. bench/kv_transfer.py --device cuda: tcp / shm / nixl / raw NIXL next to a
#    device-to-device copy, at page sizes 16 and 64 (CUDA IPC pays per descriptor);
# 4. bench/pd_overhead.py --device cuda --nixl: TTFT of PD (tcp, nixl) against
#    colocated, every engine on the GPU;
# 5. dp groups in one pod on GPUs of their own: a colocated worker with
#    `dp: <visible GPUs>` serves with each rank process on a different GPU
#    (nvidia-smi's compute apps); on a one-GPU box, `dp: 2` is refused at start
#    naming the device count instead of stacking two engines on GPU 0.
# 6. bench/engine_gpu.py: our engine alone on a random ~1B Llama in bfloat16:
#    decode tok/s at batch 1 and 64, greedy and sampled, decode CUDA graphs on
#    and off, and the peak memory of a decode step of one 8k and fifteen
#    64-token sequences.
# Every step runs even when one before it failed; the script exits non-zero
# naming the steps that failed, or at once when a package or the GPU is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
LIMIT=${GPU_CHECK_STEP_TIMEOUT:-300}  # seconds each step may take
export PYTHONUNBUFFERED=1

DEVICE=$DEVICE $PY - <<'PYCHECK' || exit 2
import importlib.util, os, sys
missing = [m for m in ("torch", "nixl", "zmq", "fastapi", "msgspec") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing packages: {missing}; install '.[dev,nixl]' first")
import torch
if os.environ["DEVICE"] == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("gpu:", name, "| torch", torch.__version__, "| python", sys.version.split()[0])
PYCHECK

failed=()
step() {
    local name=$1
    shift
    echo "== $name"
    local start=$SECONDS
    if "$@"; then
        echo "-- ok: $name ($((SECONDS - start)) s)"
    else
        echo "-- FAILED: $name ($((SECONDS - start)) s)"
        failed+=("$name")
    fi
}

gpu_tests() {
    # Each folder alone (--confcutdir): the top-level conftest imports the
    # operator's test helpers, which a GPU box without kopf cannot import.
    local ok=0
    for dir in tests/engine tests/transfer; do
        timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider -m gpu --confcutdir="$dir" "$dir" || ok=1
    done
    return $ok
}

pd_equals_colocated() {
    DEVICE=$DEVICE timeout "$LIMIT" $PY - "$OUT" <<'PYPD'
import os, random, sys
from pathlib import Path
import httpx, yaml
sys.path.insert(0, ".")
from pdcluster.runtime.cli import load_manifest
from tests.local.cluster import local_cluster
from tests.pd_integration.reference import colocated_outputs

out, device = Path(sys.argv[1]), os.environ["DEVICE"]
doc = yaml.safe_load(Path("examples/pd-1p1d-nixl.yaml").read_text())
doc["metadata"]["name"] = f"pd-1p1d-nixl-{device}"
doc["spec"]["model"] = {"name": "tiny", "computeDtype": "bfloat16"}
doc["spec"]["kvCache"]["dtype"] = "bfloat16"
for role in ("prefill", "decode"):
    doc["spec"][role]["device"] = device
path = out / f"pd-1p1d-nixl-{device}.yaml"
path.write_text(yaml.safe_dump(doc))
rng = random.Random(3)
prompts = [[rng.randrange(1, 256) for _ in range(n)] for n in (1, 16, 17, 300, 2000)]
expected = colocated_outputs(load_manifest(str(path)), prompts, 8)
with local_cluster(path, out / "state") as cluster:
    got = []
    for p in prompts:
        r = httpx.post(cluster.endpoint + "/generate", headers=cluster.auth, timeout=120, json={
            "input_ids": p,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
        r.raise_for_status()
        got.append(r.json()["output_ids"])
    for proc in cluster.state["processes"]:
        if proc["role"] in ("prefill", "decode"):
            info = httpx.get(proc["url"] + "/get_server_info", headers=cluster.auth).json()
            keys = ("transport", "ucx", "backend", "device")
            print(proc["role"], "negotiated:",
                  {k: v for k, v in info.items() if any(w in k for w in keys)})
assert got == expected, f"PD {got} != colocated {expected}"
print("PD == colocated:", len(prompts), "prompts, device", device)
PYPD
}

kv_transfer() {
    timeout "$LIMIT" $PY bench/kv_transfer.py --device "$DEVICE" --sizes 1,16,256 --repeats 3 \
        --json "$OUT/kv_transfer_$DEVICE.json" &&
        timeout "$LIMIT" $PY bench/kv_transfer.py --device "$DEVICE" --sizes 16,256 --repeats 3 \
            --page-size 64 --json "$OUT/kv_transfer_${DEVICE}_page64.json"
}

pd_overhead() {
    timeout "$LIMIT" $PY bench/pd_overhead.py --device "$DEVICE" --trials 20 --lengths 16 2000 --nixl
}

dp_on_own_gpus() {
    [[ $DEVICE == cuda ]] || { echo "skipped: needs cuda"; return 0; }
    timeout "$LIMIT" $PY - "$OUT" <<'PYDP'
import os, subprocess, sys, time
from pathlib import Path
import httpx, torch, yaml
from pdcluster.runtime.ports import free_ports

out = Path(sys.argv[1])
count = torch.cuda.device_count()
dp = max(count, 2)
doc = {"apiVersion": "pdcluster.io/v1alpha1", "kind": "PDCluster", "metadata": {"name": "dpgpu"},
       "spec": {"model": {"name": "tiny"}, "kvCache": {"numPages": 64},
                "colocated": {"device": "cuda", "topology": {"dp": dp}}}}
path = out / "dp-gpus.yaml"
path.write_text(yaml.safe_dump(doc))
port, dist = free_ports(2)
env = {**os.environ, "PDCLUSTER_TOKEN": "t"}
argv = [sys.executable, "-m", "pdcluster.runtime.cli", "worker", "-f", str(path), "--role",
        "colocated", "--port", str(port), "--dist-port", str(dist)]
proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        start_new_session=True)
try:
    if count < dp:
        text, _ = proc.communicate(timeout=240)
        assert proc.returncode != 0 and f"sees {count} CUDA devices" in text, text[-2000:]
        print(f"dp={dp} on {count} GPU(s): refused at start, as it must be")
        sys.exit(0)
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
    buses = {line.split(",")[1].strip() for line in apps.splitlines() if line.strip()}
    assert len(buses) == dp, f"{dp} dp groups on {len(buses)} GPUs: {apps}"
    print(f"dp={dp}: one engine on each of {len(buses)} GPUs")
finally:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        proc.wait(30)
PYDP
engine_gpu() {
    timeout "${GPU_CHECK_ENGINE_TIMEOUT:-480}" $PY bench/engine_gpu.py --device "$DEVICE" \
        $([ "$DEVICE" = cuda ] || echo "--dtype float32 --preset small --batch 1 4 --repeats 1")
}

step "1. tests marked gpu" gpu_tests
step "2. PD (nixl, $DEVICE, bfloat16) == colocated on 1P1D" pd_equals_colocated
step "3. kv_transfer on $DEVICE" kv_transfer
step "4. pd_overhead on $DEVICE" pd_overhead
step "5. dp groups of one pod on GPUs of their own" dp_on_own_gpus
step "6. engine decode on $DEVICE (bench/engine_gpu.py)" engine_gpu
echo "results in $OUT"
if ((${#failed[@]})); then
    printf 'gpu_check: failed: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu_check: all steps passed"
