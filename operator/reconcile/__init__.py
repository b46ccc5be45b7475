"""Reconcile: one PDCluster's desired objects against what the cluster holds.

Pure (decide): cluster (identity + validated spec), observed (typed views of
what was found), instances (pods grouped into gangs), revision (which spec
changes restart which pods), rollout (one role's per-slot decisions),
restarts (gang back-off and budget), gang (one multi-pod instance: keep,
restart whole, wait or give up; not wired yet), plan (desired vs observed → actions),
pod_groups (which PodGroups stay; roles that wait for the PodGroup API),
actions (the plan's vocabulary), status (the status from a plan), policy
(what the operator refuses to run), kv_transport (the workers' negotiated
KV transport → status entry and fallback Warning).
I/O (act): controller (one reconcile pass), executor (carries out a plan's
actions), workqueue (coalescing, delaying keys), autoscaling (one loop per
PDCluster: role scalers, scrapes, the autoscale step, its writes).
"""
