"""PDCluster runtime: everything that runs inside a pod."""
