"""The operator's tools: the ``kvray`` command (:mod:`.cli`: start, stop, status, monitor, demo,
serve), the live status view (:mod:`.watch`), Prometheus and Grafana over the cluster
(:mod:`.monitor`) and the README's demo (:mod:`.demo`)."""
