"""PDCluster operator (kopf).

Pure (decide):  names, revision, api (status models), cluster, builders/,
                observed, instances, restarts, rollout, reconcile_plan, status,
                events, structural, cel_rules, crdgen, refdoc, field_docs;
                failover decisions: pod_facts, losses, peers, failure_counts
I/O (act):      kube (REST client), executor, recorder, controller (one
                reconcile pass), workqueue, handlers (every kopf handler),
                failover (pod lost → peers' admin API, Events), admin_client,
                metrics, settings, __main__ (`python -m pdcluster.operator`)
"""
