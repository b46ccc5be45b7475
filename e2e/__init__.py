"""The local Kubernetes control plane and the end-to-end tests that run on it."""
