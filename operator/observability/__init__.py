"""What an SRE watches a PDCluster with: the Grafana dashboards (`panels`,
`dashboards`) and the Prometheus alerting rules (`alerts`) the chart ships;
`generate` writes them into the chart and docs/."""
