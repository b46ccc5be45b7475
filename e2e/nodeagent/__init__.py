"""Kubernetes without a container runtime: fake Nodes whose pods run as local processes.

Pure modules decide (`network`, `backoff`, `probes`, `podspec`, `status`);
`pod` and `agent` act (processes, API calls); `control` and `client` expose
the fault hooks (kill, freeze, thaw) over loopback HTTP.
"""
