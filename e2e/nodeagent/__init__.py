"""Kubernetes without a container runtime: fake Nodes whose pods run as local processes.

Pure modules decide: `network` (pod addresses), `backoff`, `probes`, `podspec`
(argv, environment, refused features), `status` (phase and conditions).
Modules that act: `agent` (nodes, leases, the pod watch), `pod` (one worker
thread per pod) with `container`, `podapi` and `prober`; `kubeapi` (the REST
client); `control` and `client` (the fault hooks over loopback HTTP);
`kubeletapi` (the log endpoint `kubectl logs` reaches).
"""
