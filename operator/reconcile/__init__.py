"""Reconcile: one PDCluster's desired objects against what the cluster holds.

Pure (decide): cluster (identity + validated spec), observed (typed views of
what was found), instances (pods grouped into instances, each judged as a
gang: a pod ended, lost, missing or NotReady past its grace breaks the
whole instance), revision (which spec changes restart which pods), rollout
(one role's per-slot decisions: restart a broken gang, roll, scale),
restarts (gang back-off and budget), plan (desired vs observed → actions),
pod_groups (which PodGroups stay; roles that wait for the PodGroup API),
actions (the plan's vocabulary), status (the status from a plan), policy
(what the operator refuses to run), kv_transport (the workers' negotiated
KV transport → status entry and fallback Warning).
I/O (act): controller (one reconcile pass), executor (carries out a plan's
actions), workqueue (coalescing, delaying keys), autoscaling (one loop per
PDCluster: role scalers, scrapes, the autoscale step, its writes).
"""
