"""PDCluster operator (kopf)."""
