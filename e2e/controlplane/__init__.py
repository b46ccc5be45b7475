"""Builds the Kubernetes control-plane binaries (and etcd, helm) from Go modules.

The Go module in this folder pins the versions; `build.py` turns it into
binaries cached outside the repository.
"""
