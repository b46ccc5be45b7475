"""Local mode: run a PDCluster manifest as processes on 127.0.0.1."""
