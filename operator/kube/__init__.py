"""The operator's Kubernetes I/O: the REST client and aggregated Events.

client (thin async REST client over httpx), events (pure: which Events to
write, aggregated), recorder (writes them).
"""
