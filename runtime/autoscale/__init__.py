"""Autoscaling per role, pure and shared by the operator and local mode:
planner (replicas from metrics, windows and the GPU budget) and samples (the
planner's inputs from the workers' own /metrics text). The operator's glue
lives in `pdcluster.operator.autoscale`; local mode's in
`pdcluster.runtime.local.autoscaling`.
"""
