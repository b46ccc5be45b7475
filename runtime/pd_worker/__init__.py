"""PD roles inside a worker: per-rank agents, leader coordination, HTTP backends."""
