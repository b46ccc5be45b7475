"""Autoscaling per role (pure): planner (replicas from metrics, windows and
the GPU budget), samples (the planner's inputs from the workers' /metrics),
step (one interval of a PDCluster: scrapes in; patches, Events and status
out), scaler_sync (the PDCluster's replicas and its role scalers' kept equal),
wiring (which pods to scrape, instances that exist, a scaler's writes).
The loop that runs them is `reconcile/autoscaling.py`.
"""
