"""Our KV transfer engine and control plane inside vLLM: `PDClusterConnector` and its two halves."""
