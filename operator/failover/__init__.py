"""Failover: a lost worker pod → its peers fail the affected rooms at once.

Pure (decide): pod_facts (what one pod's object says), losses (when an
instance is lost, once per loss), peers (the worker pods of every cluster),
failure_counts (cumulative counters → increases), registration (when an
unregistered prefill deserves a Warning).
I/O (act): fast_path (pod watch → peers' admin API and Events),
admin_client (the workers' admin API), prefill_peers (publishes each
cluster's prefill bootstrap addresses to its decode workers).
"""
