"""Autoscaling per role, the operator's side: step (one interval of a
PDCluster: scrapes in; patches, Events and status out), scaler_sync (the
PDCluster's replicas and its role scalers' kept equal), wiring (which pods to
scrape, instances that exist, a scaler's writes). The pure planner and
samples they use live in `pdcluster.runtime.autoscale` (local mode runs them
too). The loop that runs them is `reconcile/autoscaling.py`.
"""
