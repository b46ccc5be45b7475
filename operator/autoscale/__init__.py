"""Autoscaling per role (pure): planner (replicas from metrics, windows and
the GPU budget), samples (the planner's inputs from the workers' /metrics).
"""
